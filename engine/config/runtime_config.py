"""The runtime's configuration: the groups every part of a run is configured by.

Each command's own options (generate, bench, plan, diagnose, calibrate, serve) live beside
the CLI; the runtime takes this object only, and each part of it takes only its group.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from meshserve.compose import GROUPS, compose_config
from meshserve.engine.config.disagg_config import DisaggConfig
from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.config.speculative_config import SpeculativeConfig
from meshserve.models.model_config import ModelConfig
from meshserve.parallel.parallel_config import ParallelConfig
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.scenario import ScenarioConfig
from meshserve.validation import require

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    """Model, engine, parallel layout, cluster, scenario, speculation, disaggregation, device
    and threads
    of one run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Batching and KV cache."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The machines."""
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    """The workload the service is for."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding."""
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    """Disaggregated prefill and decode."""
    device: str = "auto"
    """auto (CUDA when present), cpu or cuda."""
    threads: int | None = None
    """torch intra-op threads per rank; null leaves torch's default."""

    def __post_init__(self) -> None:
        require(self.device in DEVICES, "device", self.device, f"one of {DEVICES}")
        require(self.threads is None or self.threads >= 1, "threads", self.threads,
                "null or an int >= 1")

    @classmethod
    def of(cls, config: RuntimeConfig) -> RuntimeConfig:
        """The runtime part of `config` (a command's config carries its options beside it)."""
        if type(config) is cls:
            return config
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


TOP_LEVEL = ("device", "threads")
"""Leaf fields of RuntimeConfig itself (the rest are in GROUPS)."""


def leaf_groups() -> dict[str, list[str]]:
    """Every leaf field name of the runtime groups -> the groups that have it."""
    defaults = RuntimeConfig()
    names: dict[str, list[str]] = {name: [""] for name in TOP_LEVEL}
    for group in GROUPS:
        for f in dataclasses.fields(getattr(defaults, group)):
            names.setdefault(f.name, []).append(group)
    return names


def kwargs_overrides(kwargs: Mapping[str, Any]) -> list[str]:
    """Hydra overrides for keyword arguments: a leaf field name unique across the groups
    (`max_num_seqs=64`), a group with a dict (`engine={"max_num_seqs": 64}`) or with a
    preset's name (`parallel="single"`). An unknown
    or ambiguous keyword raises TypeError naming the close matches and the groups."""
    leaves = leaf_groups()
    out: list[str] = []
    for key, value in kwargs.items():
        if key in GROUPS:
            if isinstance(value, str):  # a preset: parallel="single"
                out.append(f"{key}={value}")
                continue
            if not isinstance(value, Mapping):
                raise TypeError(f"{key}={value!r}: a group takes a preset name or a dict of "
                                f"its fields; its fields: {', '.join(_fields_of(key))}")
            for leaf, v in value.items():
                if leaf not in _fields_of(key):
                    raise TypeError(_unknown(f"{key}.{leaf}", leaf, _fields_of(key), key))
                out.append(f"{key}.{leaf}={_hydra_value(v)}")
            continue
        groups = leaves.get(key)
        if groups is None:
            raise TypeError(_unknown(key, key, list(leaves) + list(GROUPS), None))
        if len(groups) > 1:
            spelled = " or ".join(f"{g}={{{key!r}: ...}}" for g in groups)
            raise TypeError(f"{key}: ambiguous keyword, a field of {', '.join(groups)}; "
                            f"allowed: {spelled}")
        prefix = f"{groups[0]}." if groups[0] else ""
        out.append(f"{prefix}{key}={_hydra_value(value)}")
    return out


def load_runtime_config(overrides: Sequence[str] = (), **kwargs: Any) -> RuntimeConfig:
    """Compose the presets in conf/ with Hydra `overrides`, then keyword arguments."""
    return compose_config(RuntimeConfig, list(overrides) + kwargs_overrides(kwargs))


def _fields_of(group: str) -> list[str]:
    return [f.name for f in dataclasses.fields(getattr(RuntimeConfig(), group))]


def _unknown(key: str, name: str, allowed: Sequence[str], group: str | None) -> str:
    close = difflib.get_close_matches(name, allowed, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    where = f"fields of {group}" if group else f"groups {', '.join(GROUPS)} or a field of one"
    return f"{key}: unknown keyword argument; {hint}allowed: {where}"


def _hydra_value(value: Any) -> str:
    """`value` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"{value!r}: allowed keyword values are None, bool, int, float, str, "
                    "lists and dicts of them")
