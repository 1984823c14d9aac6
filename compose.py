"""Hydra composition: presets in conf/, schemas from frozen dataclasses, clear errors.

Generic over the schema: the runtime composes its RuntimeConfig (the offline API's
`overrides=[...]`), the CLI composes the runtime groups plus its verbs' options. Both read
the same conf/config.yaml, so a preset or an override means the same in either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

CONF_DIR = Path(__file__).resolve().parent / "conf"
GROUPS = ("model", "engine", "parallel", "cluster", "scenario", "speculative", "disagg")
T = TypeVar("T")
DEGREES = ("parallel.tp", "parallel.pp", "parallel.dp")
"""Overrides that set a layout by hand: any of them switches parallel=auto off."""


class ConfigError(ValueError):
    """A bad override or preset; the message names the key and what is allowed."""


def _schema(cls: type) -> DictConfig:
    # The dataclasses are frozen; OmegaConf would mark their nodes read-only and Hydra
    # could then not apply presets or overrides. Type checks stay; freezing returns when
    # the composed config becomes the dataclass again.
    node = OmegaConf.structured(cls)

    def thaw(n: Any) -> None:
        n._set_flag("readonly", None)
        if isinstance(n, DictConfig):
            for k in n.keys():
                thaw(n._get_node(k))

    thaw(node)
    return node


def register_schemas(schema: type) -> None:
    """Register `schema` as the root and each group's schema with Hydra's ConfigStore."""
    cs = ConfigStore.instance()
    cs.store(name="mesh_schema", node=_schema(schema))
    defaults = schema()
    for group in GROUPS:
        cs.store(group=group, name=f"{group}_schema", node=_schema(type(getattr(defaults, group))))


def presets(group: str) -> list[str]:
    """The preset names of a config group (files in conf/<group>/)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def compose_config(schema: type[T], overrides: Sequence[str] = ()) -> T:
    """Compose conf/config.yaml with Hydra `overrides` into a validated `schema` instance."""
    overrides = list(overrides)
    for ov in overrides:
        _check_override(schema, ov)
    register_schemas(schema)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("config", overrides=overrides)
    except Exception as e:  # Hydra wraps the cause; surface one readable line
        raise ConfigError(_explain(e, overrides)) from None
    if any(ov.split("=", 1)[0].lstrip("+~") in DEGREES for ov in overrides):
        cfg.parallel.auto = False  # degrees given by hand are the layout, as given
    try:
        return cast(T, OmegaConf.to_object(cfg))
    except OmegaConfBaseException as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _check_override(schema: type, ov: str) -> None:
    """Fail early, naming the key, on keys and presets that don't exist."""
    if "=" not in ov:
        raise ConfigError(f"override {ov!r}: expected key=value (for example engine.max_num_seqs=64)")
    key = ov.split("=", 1)[0].lstrip("+~")
    value = ov.split("=", 1)[1]
    parts = key.split(".")
    if len(parts) == 1 and key in GROUPS:
        names = presets(key)
        for v in value.split(","):  # sweeps list several presets
            if v not in names:
                raise ConfigError(f"{key}={v}: no such preset; allowed: {', '.join(names)}")
        return
    node: Any = schema()
    for i, p in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return  # inside a free-form dict (model.arch): any key goes
        names = [f.name for f in dataclasses.fields(node)]
        if p not in names:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"{key}: unknown key; allowed keys of {where}: {', '.join(names)}")
        node = getattr(node, p)


def _explain(e: Exception, overrides: list[str]) -> str:
    text = " ".join(str(x) for x in (e, e.__cause__) if x)
    for ov in overrides:
        if ov in text or ov.split("=", 1)[0] in text:
            return f"{ov}: {_last_line(text)}"
    return _last_line(text)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("full_key", "object_type", "reference_type"))]
    return " ".join(useful[:3])
