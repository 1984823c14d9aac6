"""What a layout will deliver for a scenario: TTFT, TPOT, throughput and goodput.

Steady serving at batch b per replica: every step decodes b tokens, and b / output_len
requests finish per step, so as many new prompts are prefilled in between; a step thus
costs the decode round plus those prefills on the slowest stage. A new request waits for
about one step before its prefill runs.

Goodput counts requests/s at the largest batch that meets both SLOs (max_batch and the KV
cache permitting). The figures are reported at an operating batch: for the latency
objective the service carries max_batch sequences in all, spread over the replicas (so
layouts are compared at the same load); otherwise each replica runs that largest batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.parallel.planner.cost_model import CostModel, StepWork
from meshserve.parallel.planner.scenario import ScenarioConfig


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted figures of one layout for one scenario (the whole cluster unless noted)."""

    batch: int
    """Operating decode batch per replica (see the module docstring)."""
    max_concurrency: int
    """Requests (prompt + output tokens) one replica's KV cache holds at once."""
    ttft_ms: float
    """Time to first token at the operating batch: one step of waiting plus the prefill."""
    latency_ms: float
    """A whole request at the operating batch: TTFT + (output_len - 1) x TPOT."""
    tpot_ms: float
    """Time per output token at the operating batch, arriving prompts' prefills included."""
    decode_ms: float
    """The decode round alone at the operating batch (no prefills)."""
    bubble_fraction: float
    """Share of that decode round the stages sit idle."""
    throughput_tok_s: float
    """Generated tokens/s of all replicas at the operating batch."""
    goodput_req_s: float
    """Requests/s that meet both SLOs (0 when even batch 1 misses them)."""
    meets_slo: bool
    """Whether the operating batch meets both SLOs."""


def serving_step_s(cost: CostModel, scenario: ScenarioConfig, batch: int) -> float:
    """One step at `batch` per replica, the prefills that keep the batch full included."""
    p, o = scenario.prompt_len, scenario.output_len
    cached = cached_tokens(scenario)
    decode = cost.tpot_s(batch, p + o / 2)
    return decode + batch / o * cost.prefill_busy_s(p, cached)


def cached_tokens(scenario: ScenarioConfig) -> int:
    """Prompt tokens expected from the prefix cache."""
    return int(scenario.prompt_len * scenario.shared_prefix_fraction)


def predict(cost: CostModel, scenario: ScenarioConfig, *, dp: int,
            kv_capacity_tokens: int) -> Prediction:
    """Figures for `scenario` on `dp` replicas whose KV caches hold `kv_capacity_tokens`."""
    p, o = scenario.prompt_len, scenario.output_len
    concurrency = kv_capacity_tokens // (p + o)
    assert concurrency >= 1, "the planner rejects layouts that can't hold one request"
    largest = min(scenario.max_batch, concurrency)
    prefill_s = cost.ttft_s(p, cached_tokens(scenario))

    def meets(b: int) -> bool:
        step = serving_step_s(cost, scenario, b)
        return step * 1e3 <= scenario.tpot_slo_ms and (prefill_s + step) * 1e3 <= scenario.ttft_slo_ms

    lo, hi = 0, largest  # the step time grows with the batch: bisect for the last b that meets
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if meets(mid) else (lo, mid - 1)
    good = dp * lo / serving_step_s(cost, scenario, lo) / o if lo else 0.0
    if scenario.objective == "latency":
        batch = min(-(-scenario.max_batch // dp), concurrency)
    else:
        batch = lo or largest
    step = serving_step_s(cost, scenario, batch)
    decode = cost.step(StepWork.decode(batch, p + o / 2))
    ttft = (prefill_s + step) * 1e3
    return Prediction(
        batch=batch, max_concurrency=concurrency, ttft_ms=ttft,
        latency_ms=ttft + (o - 1) * step * 1e3, tpot_ms=step * 1e3,
        decode_ms=decode.total_s * 1e3, bubble_fraction=decode.bubble_s / decode.total_s,
        throughput_tok_s=dp * batch / step, goodput_req_s=good, meets_slo=meets(batch))
