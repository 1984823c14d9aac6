"""Per-request records of one engine run and the benchmark metrics (docs/benchmarks/README.md)
computed from them."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """One request's outcome; times are seconds since the run's first submission."""

    arrival: float
    """When the request was submitted."""
    first_token: float | None
    """When its first generated token existed."""
    finish: float
    """When its last generated token existed."""
    num_prompt_tokens: int
    num_generated_tokens: int
    """Tokens generated for this request (a static batch's extra tokens excluded)."""
    token_ids: list[int] = field(default_factory=list)
    """The generated token ids (for the cross-engine check)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from a prefix cache."""
    num_preemptions: int = 0
    itl: list[float] = field(default_factory=list)
    """Seconds between successive outputs carrying its tokens (inter-token latency: what a
    stream stalls for); empty where the engine's runner does not record them."""

    @property
    def ttft(self) -> float | None:
        """Submission to first generated token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """(last - first token time) / (generated - 1); None below two tokens."""
        if self.first_token is None or self.num_generated_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.num_generated_tokens - 1)

    @property
    def e2e(self) -> float:
        """Submission to last generated token."""
        return self.finish - self.arrival


@dataclass
class RunResult:
    """One engine's run over a whole workload."""

    engine: str
    records: list[RequestRecord]
    """In the workload's order."""
    wall_s: float
    """First submission to last completion."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Engine-specific figures (prefix cache, decode steps, ...)."""


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float]:
    """mean, p50 and p99 of `values` (NaN when empty)."""
    return {"mean": statistics.fmean(values) if values else math.nan,
            "p50": percentile(values, 50), "p99": percentile(values, 99)}


def summarize(run: RunResult, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """The benchmark metrics of one run: throughput, latency distributions, goodput, cache."""
    recs = run.records
    gen = sum(r.num_generated_tokens for r in recs)
    prompt = sum(r.num_prompt_tokens for r in recs)
    cached = sum(r.num_cached_tokens for r in recs)
    ttft = [r.ttft for r in recs if r.ttft is not None]
    tpot = [r.tpot for r in recs if r.tpot is not None]
    good = sum(1 for r in recs if r.ttft is not None and r.ttft <= slo_ttft_s
               and (r.tpot is None or r.tpot <= slo_tpot_s))
    wall = run.wall_s
    return {
        "wall_s": wall,
        "num_requests": len(recs),
        "num_prompt_tokens": prompt,
        "num_generated_tokens": gen,
        "throughput_tok_s": gen / wall,
        "total_tok_s": (prompt + gen) / wall,
        "requests_per_s": len(recs) / wall,
        "goodput_req_s": good / wall,
        "ttft_s": distribution(ttft),
        "tpot_s": distribution(tpot),
        "itl_s": distribution([g for r in recs for g in r.itl]),
        "e2e_s": distribution([r.e2e for r in recs]),
        **_engine_counters(run, prompt, cached),
        **_rank_shares(run, wall),
    }


def _engine_counters(run: RunResult, prompt: int, cached: int) -> dict[str, Any]:
    """Prefix-cache and preemption figures, for engines that report them."""
    if "prefix_cache_queries" not in run.extra:
        return {}
    return {"prefix_cache_hit_rate": cached / prompt if prompt else 0.0,
            "num_cached_tokens": cached,
            "prefill_tokens_computed": run.extra["prefill_tokens_computed"],
            "num_preemptions": sum(r.num_preemptions for r in run.records)}


def _rank_shares(run: RunResult, wall: float) -> dict[str, Any]:
    """Each rank's share of the run's wall time busy and waiting for activations, and its
    pipeline bubble (1 - busy / wall), for engines that report ranks."""
    ranks = run.extra.get("ranks")
    if not ranks:
        return {}
    return {"ranks": {f"r{r['rank']}": {"pp_rank": r["pp_rank"], "tp_rank": r["tp_rank"],
                                         "busy": r["busy_s"] / wall,
                                         "input_wait": r["input_wait_s"] / wall,
                                         "bubble": 1.0 - r["busy_s"] / wall}
                      for r in ranks}}


def flatten(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """{'ttft_s': {'p50': x}} -> {'ttft_s.p50': x}: numeric leaves only."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
    return out


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per flattened metric over repeats: min, median and max."""
    flat = [flatten(s) for s in summaries]
    keys = [k for k in flat[0] if all(k in f for f in flat)]
    return {k: {"min": min(f[k] for f in flat), "median": statistics.median(f[k] for f in flat),
                "max": max(f[k] for f in flat)} for k in keys}
