"""Speculative decoding's configuration (the `speculative` group of conf/)."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.validation import require

METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Whether and how decodes propose tokens for one target step to verify."""

    method: str = "none"
    """none; ngram (prompt lookup: what followed the sequence's own suffix earlier in it);
    draft (a small model run beside the target)."""
    num_tokens: int = 4
    """Tokens proposed per speculating sequence and step (k)."""
    draft_model: str | None = None
    """method=draft: a preset or a Hugging Face directory whose vocabulary is the target's;
    null: the target's bundled draft (meshcoder-draft for meshcoder)."""
    prompt_lookup_min: int = 1
    """method=ngram: the shortest suffix looked up."""
    prompt_lookup_max: int = 3
    """method=ngram: the longest suffix looked up (tried first)."""
    max_batch_size: int | None = None
    """Up to this many running sequences every step drafts, above it none does (a fixed
    rule); null: the run-time switch prices each step (engine/spec/speculation_switch.py)."""
    stop_confidence: float = 0.0
    """method=draft: a sequence's draft run ends at a token the draft model gave less
    than this probability (its later tokens would mostly be rejected); 0: always k. Off
    by default: the bundled draft is unsure of most tokens it gets right (at 0.3 its runs
    shrink to 1.5 drafts and speculation stops paying, docs/benchmarks)."""
    min_acceptance: float = 0.2
    """A request whose drafts' running acceptance rate falls below this decodes plainly
    (its proposals stop costing the verify step anything)."""

    def __post_init__(self) -> None:
        require(self.method in METHODS, "speculative.method", self.method, f"one of {METHODS}")
        require(1 <= self.num_tokens <= 16, "speculative.num_tokens", self.num_tokens,
                "an int in [1, 16]")
        require(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                "speculative.prompt_lookup_min", self.prompt_lookup_min,
                f"an int in [1, prompt_lookup_max={self.prompt_lookup_max}]")
        require(self.max_batch_size is None or self.max_batch_size >= 1,
                "speculative.max_batch_size", self.max_batch_size, "null or an int >= 1")
        require(0.0 <= self.stop_confidence < 1.0, "speculative.stop_confidence",
                self.stop_confidence, "a probability in [0, 1)")
        require(0.0 <= self.min_acceptance <= 1.0, "speculative.min_acceptance",
                self.min_acceptance, "a fraction in [0, 1]")

    @property
    def enabled(self) -> bool:
        return self.method != "none"
