"""Options of the verbs that reason about layouts: `plan`, `diagnose`, `calibrate`."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.validation import require

FORMATS = ("table", "json")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """What `meshserve plan` prints."""

    format: str = "table"
    """table (for people) or json (for machines); `format=json` is accepted as a shorthand."""
    top: int = 0
    """Candidates shown in the table; 0 shows all (JSON always holds all)."""
    allow_cross_domain_tp: bool = False
    """Admit TP groups that span NVLink domains even when another layout fits."""
    detect: bool = False
    """Describe this machine's GPUs (torch.cuda, nvidia-smi, Slurm) instead of the cluster preset."""
    simulate: bool = False
    """With disagg=auto and a goodput objective (codegen, rag): pick colocated or split
    serving, and which split, by simulated goodput (the highest Poisson rate at which 90%
    of requests meet both SLOs, each layout simulated step by step) instead of the closed
    forms. Seconds to tens of seconds more."""

    def __post_init__(self) -> None:
        require(self.format in FORMATS, "plan.format", self.format, f"one of {FORMATS}")
        require(self.top >= 0, "plan.top", self.top, "an int >= 0")


@dataclass(frozen=True, kw_only=True)
class DiagnoseConfig:
    """What `meshserve diagnose` reads and prints."""

    records: str | None = None
    """A JSON-lines file of step records (one StepRecord's fields per line)."""
    format: str = "table"
    """table or json; `format=json` is accepted as a shorthand."""

    def __post_init__(self) -> None:
        require(self.format in FORMATS, "diagnose.format", self.format, f"one of {FORMATS}")


@dataclass(frozen=True, kw_only=True)
class CalibrateConfig:
    """What `meshserve calibrate` measures and where it writes the preset."""

    name: str = "calibrated"
    """Name of the written cluster preset."""
    out: str | None = None
    """Preset file to write; null writes conf/cluster/<name>.yaml in the package."""
    world_sizes: list[int] = field(default_factory=lambda: [2])
    """Group sizes for AllReduce and p2p (ranks spawned here); [] keeps the base preset's links."""
    message_bytes: list[int] = field(default_factory=lambda: [4096, 1 << 16, 1 << 20, 1 << 23])
    """Message sizes timed; latency and bandwidth are fitted over them."""
    read_bytes: int = 256 << 20
    """Tensor read to measure memory bandwidth."""
    matmul_size: int = 1024
    """N of the N x N x N matmuls timed for FLOP/s (fp32 and bf16)."""
    repeats: int = 5
    """Timed repeats per figure (the best counts)."""
    runtime: bool = True
    """Time meshserve's own engine on tiny random models for its per-step and per-layer
    overhead (else a stand-in layer gives the per-layer figure and per-step stays 0)."""
    runtime_tokens: int = 32
    """Decode steps timed per tiny model."""

    def __post_init__(self) -> None:
        require(self.runtime_tokens >= 4, "calibrate.runtime_tokens", self.runtime_tokens,
                "an int >= 4")
        require(bool(self.name) and "/" not in self.name, "calibrate.name", self.name,
                "a preset name without '/'")
        require(all(w >= 2 for w in self.world_sizes), "calibrate.world_sizes",
                self.world_sizes, "group sizes >= 2")
        require(len(self.message_bytes) >= 2 and min(self.message_bytes) >= 4,
                "calibrate.message_bytes", self.message_bytes, "two or more sizes >= 4 bytes")
        require(self.read_bytes >= 1 << 20, "calibrate.read_bytes", self.read_bytes, ">= 1 MiB")
        require(self.matmul_size >= 16, "calibrate.matmul_size", self.matmul_size, "an int >= 16")
        require(self.repeats >= 1, "calibrate.repeats", self.repeats, "an int >= 1")
