"""A serving scenario: what users of the service care about, and its SLOs."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.validation import require

OBJECTIVES = ("latency", "throughput", "utilization", "ttft_throughput")


@dataclass(frozen=True, kw_only=True)
class ScenarioConfig:
    """The workload a layout is chosen for (chatbot, codegen, offline batch, RAG)."""

    name: str = "chatbot"
    """Preset name."""
    objective: str = "latency"
    """First metric: latency, throughput, utilization or ttft_throughput."""
    prompt_len: int = 512
    """Typical prompt length, tokens."""
    output_len: int = 256
    """Typical output length, tokens."""
    shared_prefix_fraction: float = 0.0
    """Share of prompt tokens expected to hit the prefix cache."""
    ttft_slo_ms: float = 500.0
    """Time-to-first-token target."""
    tpot_slo_ms: float = 50.0
    """Time-per-output-token target."""
    max_batch: int = 64
    """Largest decode batch the scenario wants."""
    speculative: bool = True
    """Whether speculative decoding pays here (small batches)."""

    def __post_init__(self) -> None:
        require(self.objective in OBJECTIVES, "scenario.objective", self.objective,
                f"one of {OBJECTIVES}")
        for n in ("prompt_len", "output_len", "max_batch"):
            require(getattr(self, n) >= 1, f"scenario.{n}", getattr(self, n), "an int >= 1")
        require(0.0 <= self.shared_prefix_fraction <= 1.0, "scenario.shared_prefix_fraction",
                self.shared_prefix_fraction, "a fraction in [0, 1]")
        require(self.ttft_slo_ms > 0 and self.tpot_slo_ms > 0, "scenario.ttft_slo_ms/tpot_slo_ms",
                (self.ttft_slo_ms, self.tpot_slo_ms), "numbers > 0")
