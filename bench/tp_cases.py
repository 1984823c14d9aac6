"""The tensor-parallel comparison's cases: the same prompts for every engine.

Three cases, each greedy with EOS ignored:
- `ttft`: one 512-token prompt, one new token: time to the first token;
- `decode-1`: one 256-token prompt, then batch-1 decode: time per output token;
- `decode-32`: 32 prompts of 16 tokens, then batch-32 decode: time per decode step
  (short prompts: on two cores a longer prefill of 32 prompts takes minutes on 'big').

An engine reports, per case, the seconds of each repeat and the generated token ids, as a
`CaseResult`; `tp_check` compares them across engines.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import asdict, dataclass, field

SEED = 0


@dataclass(frozen=True)
class Case:
    """One measured case: prompts (token ids) and how many tokens each generates."""

    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    metric: str
    """'ttft_s' (prefill to the first token) or 'tpot_s' (seconds per decode step)."""


@dataclass
class CaseResult:
    """The seconds of each repeat and the last repeat's token ids, one list per prompt."""

    name: str
    metric: str
    seconds: list[float] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)

    def as_dict(self) -> dict:
        """Plain data for JSON."""
        return asdict(self)


def _prompt(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Ids from 1 up: 0 is the peers' pad id, and a random model has no special tokens.
    return [rng.randrange(1, vocab_size) for _ in range(n)]


CASE_NAMES = ("ttft", "decode-1", "decode-32")


def make_cases(vocab_size: int, decode_tokens: int = 32, seed: int = SEED) -> list[Case]:
    """The three cases, the same for every engine given the vocabulary size and seed."""
    rng = random.Random(seed)
    return [
        Case("ttft", [_prompt(rng, 512, vocab_size)], 1, "ttft_s"),
        Case("decode-1", [_prompt(rng, 256, vocab_size)], decode_tokens, "tpot_s"),
        Case("decode-32", [_prompt(rng, 16, vocab_size) for _ in range(32)], decode_tokens,
             "tpot_s"),
    ]


def select_cases(cases: list[Case], names: str) -> list[Case]:
    """The cases named in the comma-separated `names`, in their usual order."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(CASE_NAMES))
    if unknown or not wanted:
        raise ValueError(f"cases={names!r}: allowed are comma-separated names from "
                         f"{list(CASE_NAMES)}")
    return [c for c in cases if c.name in wanted]


def warmup_case(vocab_size: int) -> Case:
    """A short run before the measured ones: first-call allocations, lazy builds."""
    return Case("warm-up", [_prompt(random.Random(SEED + 1), 16, vocab_size)] * 2, 4, "tpot_s")


def median_step_seconds(token_times: list[float]) -> float:
    """The median gap between consecutive generated tokens: one decode step's seconds."""
    if len(token_times) < 2:
        raise ValueError(f"{len(token_times)} token times: a decode step needs at least 2")
    return statistics.median(b - a for a, b in zip(token_times, token_times[1:]))
