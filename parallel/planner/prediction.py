"""What a layout will deliver for a scenario: TTFT, TPOT, throughput and goodput.

Steady serving at batch b per replica: every step decodes b tokens, and b / output_len
requests finish per step, so as many new prompts are prefilled in between; a step thus
costs the decode round plus those prefills on the slowest stage. A new request waits for
about one step before its prefill runs.

Where the scenario speculates, the decode round is also priced with speculative decoding:
a draft model's k steps plus one target step verifying k + 1 tokens per sequence, over the
tokens it emits (the accepted drafts and one more), at an acceptance stated here
(SPEC_ACCEPTED of SPEC_TOKENS drafts per verify step; the bundled pair accepts about 2).

Goodput is the highest Poisson rate at which ATTAINMENT of the requests meet both SLOs,
the waits and stalls that decide it priced (goodput.py). The other figures are the mean
request's at an operating batch: for the latency objective the service carries max_batch
sequences in all, spread over the replicas (so layouts are compared at the same load);
otherwise each replica runs the largest batch whose mean step meets both SLOs (max_batch
and the KV cache permitting).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.parallel.planner.cost_model import CostModel, StepWork
from meshserve.parallel.planner.goodput import colocated_goodput
from meshserve.parallel.planner.scenario import ScenarioConfig

SPEC_TOKENS = 4
"""Drafts per verify step the plan assumes (speculative.num_tokens' default)."""
SPEC_ACCEPTED = 2.0
"""Drafts a verify step accepts on average, as the plan assumes."""
DRAFT_STEP_FRACTION = 0.15
"""A draft model's decode step as a share of the target's at the same batch: a draft of
about a tenth of the target's weights, its kernel launches and per-layer work keeping it
above its weight share."""


def speculative_step_s(cost: CostModel, batch: float, context: float, k: int = SPEC_TOKENS,
                       draft: CostModel | None = None, drafts: bool = True) -> float:
    """One speculative decode step of `batch` sequences: k draft steps (of the `draft`
    model's cost, else DRAFT_STEP_FRACTION of the target's; none with `drafts` false, as
    prompt lookup proposes on the host) and a verify of k + 1 tokens each (the weights
    and each context read once)."""
    rows = batch * (k + 1)
    verify = StepWork(num_new_tokens=rows, num_seqs=rows, num_kv_read=batch * context,
                      num_attended=rows * (context + 1 + k / 2))
    step = (draft.tpot_s(batch, context) if draft is not None
            else DRAFT_STEP_FRACTION * cost.tpot_s(batch, context))
    return cost.step(verify).total_s + (k * step if drafts else 0.0)


def speculative_tpot_s(cost: CostModel, batch: float, context: float,
                       k: int = SPEC_TOKENS, accepted: float = SPEC_ACCEPTED) -> float:
    """Time per output token decoding `batch` sequences speculatively, per the 1 +
    `accepted` tokens a verify step emits."""
    return speculative_step_s(cost, batch, context, k) / (1 + accepted)


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
    """Requests/s served with ATTAINMENT of them within both SLOs (goodput.py)."""
    meets_slo: bool
    """Whether the operating batch meets both SLOs."""
    speculative_decode_ms: float | None = None
    """Where the scenario speculates: the decode round's time per output token with
    speculative decoding at the operating batch (SPEC_ACCEPTED of SPEC_TOKENS drafts
    accepted); compare with decode_ms. None where the scenario does not speculate."""


def serving_step_s(cost: CostModel, scenario: ScenarioConfig, batch: int) -> float:
    """One step at `batch` per replica, the prefills that keep the batch full included."""
    p, o = scenario.prompt_len, scenario.output_len
    cached = cached_tokens(scenario)
    decode = cost.tpot_s(batch, p + o / 2)
    return decode + batch / o * cost.prefill_busy_s(p, cached)


def cached_tokens(scenario: ScenarioConfig) -> int:
    """Prompt tokens expected from the prefix cache."""
    return int(scenario.prompt_len * scenario.shared_prefix_fraction)


def predict(cost: CostModel, scenario: ScenarioConfig, *, dp: int, kv_capacity_tokens: int,
            step_tokens: int = 2048) -> Prediction:
    """Figures for `scenario` on `dp` replicas whose KV caches hold `kv_capacity_tokens`,
    whose steps carry at most `step_tokens`."""
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
    good = colocated_goodput(cost, scenario, dp=dp, largest=largest,
                             cached=cached_tokens(scenario), step_tokens=step_tokens)
    if scenario.objective == "latency":
        batch = min(-(-scenario.max_batch // dp), concurrency)
    else:
        batch = lo or largest
    step = serving_step_s(cost, scenario, batch)
    decode = cost.step(StepWork.decode(batch, p + o / 2))
    ttft = (prefill_s + step) * 1e3
    spec = (speculative_tpot_s(cost, batch, p + o / 2) * 1e3 if scenario.speculative
            else None)
    return Prediction(
        batch=batch, max_concurrency=concurrency, ttft_ms=ttft,
        latency_ms=ttft + (o - 1) * step * 1e3, tpot_ms=step * 1e3,
        decode_ms=decode.total_s * 1e3, bubble_fraction=decode.bubble_s / decode.total_s,
        throughput_tok_s=dp * batch / step, goodput_req_s=good, meets_slo=meets(batch),
        speculative_decode_ms=spec)
