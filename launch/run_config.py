"""The whole run's configuration: every group plus what the verbs themselves take."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshserve.engine.config import EngineConfig
from meshserve.models.config import ModelConfig
from meshserve.parallel.cluster import ClusterConfig
from meshserve.parallel.config import ParallelConfig
from meshserve.parallel.scenario import ScenarioConfig
from meshserve.validation import require

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    """What `meshserve generate` asks the model."""

    prompts: list[str] = field(default_factory=lambda: [
        "def fibonacci(n):", "import os\n\nclass ", "    def __init__(self,"])
    """Prompts to complete."""
    max_tokens: int = 48
    """Tokens to generate per prompt."""
    temperature: float = 0.0
    """0 is greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 is off."""
    seed: int | None = None
    """Per-request seed."""
    ignore_eos: bool = False
    """Keep generating past EOS."""

    def __post_init__(self) -> None:
        require(len(self.prompts) >= 1, "generate.prompts", self.prompts, "at least one prompt")


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Everything one meshserve run is configured by (Hydra groups and verb options)."""

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
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    """Options of `meshserve generate`."""
    device: str = "auto"
    """auto (CUDA when present), cpu or cuda."""
    threads: int | None = None
    """torch intra-op threads per rank; null leaves torch's default."""

    def __post_init__(self) -> None:
        require(self.device in DEVICES, "device", self.device, f"one of {DEVICES}")
        require(self.threads is None or self.threads >= 1, "threads", self.threads,
                "null or an int >= 1")
