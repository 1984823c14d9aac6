"""Prefill/decode splits beside colocated layouts (disagg=auto; DistServe's placement search).

A split gives `prefill.replicas` replicas of prefill.tp x prefill.pp devices the prompts
and `decode.replicas` replicas of decode.tp x decode.pp devices the rest of every request;
each request's prompt KV crosses from one to the other. Ranks are placed as the runtime
starts them: prefill replicas first, device by device, then decode replicas.

The figures, for the scenario's typical request (prompt p, output o):
  - prefill replicas: busy D = the prompt's prefill for each request; the replicas share
    one queue of prompts (M/D/c), so the mean TTFT is its mean wait plus the prefill alone
    (for one replica at rate λ, λD² / 2(1 - λD)). The first token comes from the prefill
    replica.
  - KV hop: the prompt's KV bytes over the link the two replicas share (NVLink or shared
    memory inside a node, InfiniBand across nodes when the replicas span nodes), every rank
    moving its own piece at once; what is left of it after the first token (all of it, or
    with the prompt read layer by layer as it is computed only its last prefill step's last
    layer) delays the second token, so it is spread over TPOT.
  - decode replica: decode-only steps at batch b (no prefill between them): TPOT = the step
    + the hop / (o - 1).
Goodput is the highest arrival rate at which ATTAINMENT of the requests meet both SLOs
(goodput.py): the share of prompts whose wait fits the TTFT budget, times the share of
requests whose decode batch (Poisson about its mean) keeps TPOT within its SLO.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from meshserve.parallel.comm.mesh import divisors
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.cost_model import CostModel, StepWork
from meshserve.parallel.planner.goodput import ATTAINMENT, DecodeTail, attained_rate
from meshserve.parallel.planner.layout_sim import (
    Replicas,
    capacity_colocated,
    capacity_disagg,
    hop_bytes_s,
    hop_link,
    hop_tokens,
    scenario_requests,
    simulate_colocated,
    simulate_disagg,
    steady_requests,
)
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.placement import Plan
from meshserve.parallel.planner.prediction import Prediction, cached_tokens
from meshserve.parallel.planner.rate_search import max_rate
from meshserve.parallel.planner.scenario import ScenarioConfig
from meshserve.parallel.planner.search import (
    METRICS,
    Candidate,
    PlannerOptions,
    figure,
    metric,
    plan,
    score,
    sized,
)
from meshserve.parallel.planner.serving_sim import Attainment, SimRequest
from meshserve.parallel.planner.tails import mean_wait_s, wait_within


@dataclass(frozen=True, kw_only=True)
class Phase:
    """One phase's replicas: their degrees, and the sizing of one of them."""

    tp: int
    pp: int
    replicas: int
    sizing: Candidate
    """tp x pp of one replica as the colocated planner sizes it (memory, KV capacity)."""

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.replicas

    @property
    def text(self) -> str:
        """'2 x (tp=2 pp=1)'."""
        return f"{self.replicas} x (tp={self.tp} pp={self.pp})"


@dataclass(frozen=True, kw_only=True)
class SplitCandidate:
    """One prefill/decode split the planner weighed."""

    prefill: Phase
    decode: Phase
    link: str = "intra"
    """The link the KV hop crosses: intra (inside a node) or inter (across nodes)."""
    kv_bytes: float = 0.0
    """Prompt KV one request moves (its cached prefix is not sent)."""
    transfer_ms: float = 0.0
    """The hop of one request's KV after its first token (with the prompt read as it is
    computed, its last prefill step's share)."""
    prefill_capacity_req_s: float = 0.0
    """Requests/s the prefill replicas carry within the TTFT SLO."""
    decode_capacity_req_s: float = 0.0
    """Requests/s the decode replicas carry within the TPOT SLO."""
    prediction: Prediction | None = None
    rejected: str | None = None

    @property
    def degrees(self) -> str:
        """'P 1 x (tp=1 pp=1) + D 1 x (tp=2 pp=1)'."""
        return f"P {self.prefill.text} + D {self.decode.text}"

    @property
    def bound_by(self) -> str:
        """Which side limits goodput."""
        return ("prefill" if self.prefill_capacity_req_s <= self.decode_capacity_req_s
                else "decode")


def last_true(n: int, holds: Callable[[int], bool]) -> int:
    """The largest b in 1..n where `holds` (true up to some b, false after), else 0."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid - 1)
    return lo


def kv_link(prefill: Phase, decode: Phase, cluster: ClusterConfig) -> str:
    """The link the split's KV hop crosses (layout_sim.hop_link)."""
    return hop_link(prefill.devices + decode.devices, cluster)


def hop_s(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig, prefill: Phase,
          decode: Phase, link: str, step_tokens: int | None = None) -> tuple[float, float]:
    """(bytes, seconds after the first token) of one request's KV hop: every rank pair
    moves its piece at once, so the bytes spread over as many links as the smaller side has
    ranks. With `step_tokens` (the prompt read as its prefill steps of that many tokens
    compute it, layer by layer; a pipelined prefill side streams nothing) only the last
    layer of the last step's KV is left to move after the first token; the bytes are all
    of it."""
    tokens = scenario.prompt_len - cached_tokens(scenario)
    lanes = min(prefill.tp * prefill.pp, decode.tp * decode.pp)
    nbytes = hop_bytes_s(shape, cluster, link, tokens, lanes)[0]
    left = hop_tokens(tokens, step_tokens if prefill.pp == 1 else None, shape.num_layers)
    return nbytes, hop_bytes_s(shape, cluster, link, left, lanes)[1]


def predict_split(prefill_cost: CostModel, decode_cost: CostModel, scenario: ScenarioConfig,
                  prefill: Phase, decode: Phase, transfer_s: float
                  ) -> tuple[Prediction, float, float]:
    """The split's figures (at its goodput rate, or at saturation when it has none), and
    the rates its prefill and decode replicas carry within the SLOs."""
    p, o = scenario.prompt_len, scenario.output_len
    cached = cached_tokens(scenario)
    busy = prefill_cost.prefill_busy_s(p, cached)
    alone = prefill_cost.ttft_s(p, cached)
    context = p + o / 2
    concurrency = decode.sizing.kv_capacity_tokens // (p + o)
    largest = max(1, min(scenario.max_batch, concurrency))

    def step_s(b: int) -> float:
        return decode_cost.tpot_s(b, context)

    def tpot_s(b: int) -> float:
        return step_s(b) + transfer_s / max(1, o - 1)

    ttft_budget = scenario.ttft_slo_ms / 1e3 - alone
    tail = DecodeTail(decode_cost, scenario, largest, extra_s=transfer_s)

    def prefill_share(rate: float) -> float:
        return wait_within(ttft_budget, rate, busy, prefill.replicas)

    def decode_share(rate: float) -> float:
        return tail.share(rate / decode.replicas)

    prefill_top = prefill.replicas / busy
    decode_top = decode.replicas * largest / (max(1, o - 1) * step_s(1))
    prefill_cap = attained_rate(prefill_share, upper=prefill_top)
    decode_cap = attained_rate(decode_share, upper=decode_top)
    good = attained_rate(lambda r: prefill_share(r) * decode_share(r),
                         upper=min(prefill_top, decode_top))
    saturated = min(prefill.replicas / busy * 0.99,
                    decode.replicas * largest / (step_s(largest) * o))
    if scenario.objective == "latency":  # the colocated planner's load: max_batch in all
        batch = min(-(-scenario.max_batch // decode.replicas), largest)
        rate = min(decode.replicas * batch / (step_s(batch) * o), saturated)
    else:  # the goodput rate, else what the slower side carries at all
        rate = good or saturated
        per_decode = rate / decode.replicas  # the smallest batch carrying it
        batch = min(largest, 1 + last_true(largest, lambda b: b / (step_s(b) * o)
                                           < per_decode))
    ttft = (alone + mean_wait_s(rate, busy, prefill.replicas)) * 1e3
    tpot = tpot_s(batch) * 1e3
    decode_step = decode_cost.step(StepWork.decode(batch, context))
    pred = Prediction(
        batch=batch, max_concurrency=concurrency, ttft_ms=ttft,
        latency_ms=ttft + (o - 1) * tpot, tpot_ms=tpot, decode_ms=decode_step.total_s * 1e3,
        bubble_fraction=decode_step.bubble_s / decode_step.total_s,
        throughput_tok_s=rate * o, goodput_req_s=good,
        meets_slo=good > 0 and ttft <= scenario.ttft_slo_ms and tpot <= scenario.tpot_slo_ms)
    return pred, prefill_cap, decode_cap


def phases(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
           num_devices: int, options: PlannerOptions
           ) -> list[tuple[Phase, CostModel | None]]:
    """Every phase layout on exactly `num_devices`: replicas x tp x pp."""
    out = []
    for tp in divisors(num_devices):
        for pp in divisors(num_devices // tp):
            sizing, cost = sized(shape, cluster, scenario, tp, pp, options)
            out.append((Phase(tp=tp, pp=pp, replicas=num_devices // tp // pp, sizing=sizing),
                        cost))
    return out


def evaluate_split(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                   prefill: tuple[Phase, CostModel | None],
                   decode: tuple[Phase, CostModel | None],
                   options: PlannerOptions) -> SplitCandidate:
    """One split's figures, or why it can't run."""
    (pre, pre_cost), (dec, dec_cost) = prefill, decode
    cand = SplitCandidate(prefill=pre, decode=dec)
    for side, phase in (("prefill", pre), ("decode", dec)):
        if phase.sizing.rejected:
            return replace(cand, rejected=f"{side}: {phase.sizing.rejected}")
        if phase.sizing.warning and not options.allow_cross_domain_tp:
            return replace(cand, rejected=f"{side}: {phase.sizing.warning}")
    assert pre_cost is not None and dec_cost is not None
    link = kv_link(pre, dec, cluster)
    nbytes, transfer = hop_s(shape, cluster, scenario, pre, dec, link,
                             options.max_num_batched_tokens if options.streamed_hop else None)
    pred, pre_cap, dec_cap = predict_split(pre_cost, dec_cost, scenario, pre, dec, transfer)
    return replace(cand, link=link, kv_bytes=nbytes, transfer_ms=transfer * 1e3,
                   prefill_capacity_req_s=pre_cap, decode_capacity_req_s=dec_cap,
                   prediction=pred)


def splits(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
           options: PlannerOptions | None = None) -> list[SplitCandidate]:
    """Every prefill/decode split of the cluster's devices (all of them, or with
    fill_cluster false any count from 2 up), accepted ones best first by the scenario's
    objective, then the rejected."""
    options = options or PlannerOptions()
    counts = [cluster.num_devices] if options.fill_cluster else range(2, cluster.num_devices + 1)
    by_count: dict[int, list[tuple[Phase, CostModel | None]]] = {}

    def layouts(n: int) -> list[tuple[Phase, CostModel | None]]:
        if n not in by_count:
            by_count[n] = phases(shape, cluster, scenario, n, options)
        return by_count[n]

    cands = [evaluate_split(shape, cluster, scenario, pre, dec, options)
             for n in counts for n_pre in range(1, n)
             for pre in layouts(n_pre) for dec in layouts(n - n_pre)]
    ok = [c for c in cands if c.rejected is None]

    def key(c: SplitCandidate) -> tuple[bool, float]:
        assert c.prediction is not None
        return (not c.prediction.meets_slo, -score(c, scenario))

    def simplicity(c: SplitCandidate) -> tuple[int, int, int, float]:
        assert c.prediction is not None
        return (c.prefill.devices + c.decode.devices, c.prefill.pp + c.decode.pp,
                c.prefill.tp + c.decode.tp, c.prediction.ttft_ms)

    ordered = sorted(ok, key=key)
    if ordered:  # the simplest split within the margin of the best leads
        top, meets = score(ordered[0], scenario), key(ordered[0])[0]
        close = [c for c in ordered if key(c)[0] == meets
                 and score(c, scenario) >= top - options.simplicity_margin * abs(top)]
        chosen = min(close, key=simplicity)
        ordered = [chosen] + [c for c in ordered if c is not chosen]
    return ordered + [c for c in cands if c.rejected is not None]


def better_kind(colocated: Candidate, split: SplitCandidate | None,
                scenario: ScenarioConfig, margin: float) -> str:
    """'disaggregated' when the best split beats the best colocated layout by more than
    `margin` on the scenario's metric (meeting the SLOs first), else 'colocated': the
    simpler service wins a near-tie."""
    if split is None or split.prediction is None:
        return "colocated"
    assert colocated.prediction is not None
    if split.prediction.meets_slo != colocated.prediction.meets_slo:
        return "disaggregated" if split.prediction.meets_slo else "colocated"
    top = score(colocated, scenario)
    return ("disaggregated" if score(split, scenario) > top + margin * abs(top)
            else "colocated")


def describe(c: SplitCandidate, scenario: ScenarioConfig) -> str:
    """A sentence on one split's figures."""
    p = c.prediction
    assert p is not None
    return (f"{c.degrees}: goodput {p.goodput_req_s:.3g} req/s (prefill side "
            f"{c.prefill_capacity_req_s:.3g}, decode side {c.decode_capacity_req_s:.3g}: "
            f"bound by {c.bound_by}); TTFT {p.ttft_ms:.1f} ms, TPOT {p.tpot_ms:.2f} ms at "
            f"batch {p.batch}; KV hop {c.kv_bytes / 1e6:.3g} MB over the "
            f"{'in-node' if c.link == 'intra' else 'cross-node'} link, {c.transfer_ms:.2f} ms "
            "of it after the first token")


@dataclass(frozen=True, kw_only=True)
class KindChoice:
    """disagg=auto's answer: the best colocated plan, every split, and which kind won."""

    colocated: Plan
    splits: list[SplitCandidate]
    kind: str
    """colocated or disaggregated."""
    explanation: str
    simulated_goodput_req_s: tuple[float, float] | None = None
    """(colocated, best split) simulated goodput, where plan.simulate chose by it."""

    @property
    def split(self) -> SplitCandidate | None:
        """The best accepted split, if any."""
        return self.splits[0] if self.splits and self.splits[0].rejected is None else None


def choose_kind(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                options: PlannerOptions | None = None,
                accept: Callable[[SplitCandidate], str | None] | None = None) -> KindChoice:
    """Colocated layouts and prefill/decode splits for the scenario, and the better kind.
    `accept`: why a split can't run here (a launcher's one-rank replicas, say), else None.

    The closed forms decide, and the simulation checks the two finalists at one rate;
    with options.simulate and a goodput objective, the simulation decides: the colocated
    layout against the closed forms' best SIM_SPLITS splits, by simulated goodput."""
    options = options or PlannerOptions()
    colocated = plan(shape, cluster, scenario, options)
    found = splits(shape, cluster, scenario, options)
    if accept is not None:
        marked = [c if c.rejected or (why := accept(c)) is None else replace(c, rejected=why)
                  for c in found]
        found = [c for c in marked if c.rejected is None] + [c for c in marked if c.rejected]
    best = colocated.candidates[0]
    if not found or found[0].rejected is not None:
        why = (f"No prefill/decode split fits ({found[0].degrees}: {found[0].rejected})"
               if found else "No prefill/decode split: the cluster has one device")
        return KindChoice(colocated=colocated, splits=found, kind="colocated",
                          explanation=f"{why}; colocated {best.degrees}.")
    if options.simulate and METRICS[scenario.objective][1] == "req/s":
        return _by_simulation(shape, cluster, scenario, options, colocated, found)
    top = found[0]
    kind = better_kind(best, top, scenario, options.simplicity_margin)
    ignored = (f" (plan.simulate ranks goodput objectives only; {scenario.name} ranks by "
               f"{METRICS[scenario.objective][0]})" if options.simulate else "")
    text = (f"{_closed_forms(best, top, scenario)}, "
            f"{_verdict(kind, score(top, scenario) > score(best, scenario), options)}."
            f"{simulated(shape, cluster, scenario, options, best, top)}{ignored}")
    return KindChoice(colocated=colocated, splits=found, kind=kind, explanation=text)


def _closed_forms(best: Candidate, top: SplitCandidate, scenario: ScenarioConfig,
                  split_label: str = "Best split") -> str:
    name, unit, _ = METRICS[scenario.objective]
    a, b = metric(best, scenario), metric(top, scenario)
    return (f"Best colocated {best.degrees}: {name} {figure(a)} {unit}. {split_label} "
            f"{describe(top, scenario)}; {name} {figure(b)} {unit} ({_relative(b, a)})")


def _relative(x: float, base: float) -> str:
    """x against base, as a signed percentage (or which one is zero)."""
    if base:
        return f"{(x - base) / base:+.1%}"
    return "both zero" if not x else "against zero"


def _verdict(kind: str, split_ahead: bool, options: PlannerOptions) -> str:
    if kind == "disaggregated":
        return "so the split wins"
    if split_ahead:
        return (f"within the {options.simplicity_margin:.0%} margin, so the simpler "
                "colocated service wins")
    return "so colocated serving wins"


SIM_SPLITS = 3
"""Splits, best first by the closed forms, whose simulated goodput plan.simulate weighs."""


def _by_simulation(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                   options: PlannerOptions, colocated: Plan, found: list[SplitCandidate]
                   ) -> KindChoice:
    """The colocated layout the planner chose against the closed forms' best SIM_SPLITS
    splits, by simulated goodput: the best of them leads the splits, and the better kind
    wins by more than the simplicity margin (else colocated serving)."""
    best = colocated.candidates[0]
    shortlist = [c for c in found[:SIM_SPLITS] if c.rejected is None]
    colo_g = simulated_goodput(shape, cluster, scenario, options, best)
    ranked = sorted(((simulated_goodput(shape, cluster, scenario, options, c), i)
                     for i, c in enumerate(shortlist)), key=lambda gi: (-gi[0], gi[1]))
    order = [shortlist[i] for _, i in ranked]
    found = order + found[len(shortlist):]
    split_g = ranked[0][0]
    kind = ("disaggregated" if split_g > colo_g * (1 + options.simplicity_margin)
            else "colocated")
    text = (f"{_closed_forms(best, found[0], scenario, 'Split')}. Simulated goodput (the highest "
            f"Poisson rate, below the layout's saturated throughput, at which "
            f"{ATTAINMENT:.0%} of the requests meet both SLOs, arrivals spanning "
            f"{SIM_LIFETIMES:g} request lifetimes): colocated "
            f"{figure(colo_g)} req/s, the split {figure(split_g)} req/s "
            f"({_relative(split_g, colo_g)}; the best of the closed forms' top "
            f"{len(shortlist)}, each searched to within 5%), "
            f"{_verdict(kind, split_g > colo_g, options)}.")
    return KindChoice(colocated=colocated, splits=found, kind=kind, explanation=text,
                      simulated_goodput_req_s=(colo_g, split_g))


def simulated_goodput(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                      options: PlannerOptions, layout: Candidate | SplitCandidate) -> float:
    """DistServe's goodput of a layout: the highest Poisson rate at which ATTAINMENT of
    requests of the scenario's lengths meet both SLOs, simulated step by step on the cost
    model (layout_sim), the arrivals spanning SIM_LIFETIMES of the layout's predicted
    request lifetime; searched from the closed form's goodput to within 5%. Only rates
    below the layout's saturated throughput count: above it the queue grows for good,
    though a finite run may end before the SLOs' slack (a long output's TPOT budget
    absorbs a long wait for a decode slot) runs out."""
    p = layout.prediction
    if p is None:
        return 0.0
    lifetime = _lifetime_s(p, scenario)
    capacity = _capacity(shape, cluster, scenario, options, layout)

    def served(rate: float) -> bool:
        if rate >= capacity:  # the queue grows without end, however long its SLO slack
            return False
        reqs = scenario_requests(scenario, rate, steady_requests(rate, lifetime,
                                                                 SIM_LIFETIMES))
        got = _simulate(shape, cluster, scenario, options, layout, reqs)
        return got is not None and got.attained >= ATTAINMENT

    if capacity <= 0:
        return 0.0
    guess = min(p.goodput_req_s, capacity) if p.goodput_req_s > 0 else capacity
    return max_rate(served, guess if guess < float("inf") else 1.0)


def _lifetime_s(p: Prediction, scenario: ScenarioConfig) -> float:
    """A request's predicted life: its TTFT and the rest of its output."""
    return (p.ttft_ms + (scenario.output_len - 1) * p.tpot_ms) / 1e3


def _sides(split: SplitCandidate, budget: int) -> tuple[Replicas, Replicas]:
    pre, dec = split.prefill, split.decode
    return (Replicas(pre.tp, pre.pp, pre.replicas, budget),
            Replicas(dec.tp, dec.pp, dec.replicas, budget))


def _simulate(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
              options: PlannerOptions, layout: Candidate | SplitCandidate,
              reqs: list[SimRequest]) -> Attainment | None:
    """`layout` serving `reqs`, simulated (layout_sim)."""
    budget = options.max_num_batched_tokens
    if isinstance(layout, SplitCandidate):
        return simulate_disagg(shape, cluster, scenario, options, *_sides(layout, budget),
                               reqs)
    return simulate_colocated(shape, cluster, scenario, options,
                              Replicas(layout.tp, layout.pp, layout.dp, budget), reqs)


def _capacity(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
              options: PlannerOptions, layout: Candidate | SplitCandidate) -> float:
    """`layout`'s saturated throughput, simulated (layout_sim)."""
    budget = options.max_num_batched_tokens
    if isinstance(layout, SplitCandidate):
        return capacity_disagg(shape, cluster, scenario, options, *_sides(layout, budget))
    return capacity_colocated(shape, cluster, scenario, options,
                              Replicas(layout.tp, layout.pp, layout.dp, budget))


SIM_LIFETIMES = 3.0
"""Lifetimes of a request the arrivals of choose_kind's check span (steady_requests)."""


def simulated(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
              options: PlannerOptions, colocated: Candidate, split: SplitCandidate) -> str:
    """A sentence on the two finalists serving requests of the scenario's lengths,
    arriving as a Poisson process at the higher of their predicted goodputs for
    SIM_LIFETIMES lifetimes of a request (the longer finalist's predicted TTFT and
    decode), simulated step by step on the cost model (layout_sim): the share of
    requests each serves within both SLOs, queueing and the prompts beside decodes
    included, which the closed forms above price for the mean request only."""
    preds = [p for p in (colocated.prediction, split.prediction) if p is not None]
    rate = max((p.goodput_req_s for p in preds), default=0.0)
    if rate <= 0:
        return ""
    lifetime = max(_lifetime_s(p, scenario) for p in preds)
    num = steady_requests(rate, lifetime, SIM_LIFETIMES)
    reqs = scenario_requests(scenario, rate, num)
    colo = _simulate(shape, cluster, scenario, options, colocated, reqs)
    disagg = _simulate(shape, cluster, scenario, options, split, reqs)
    if colo is None or disagg is None:
        return ""
    span = reqs[-1].arrival_s / lifetime if lifetime > 0 else float("inf")
    return (f" Simulated at {figure(rate)} req/s over {num} requests of these lengths "
            f"({span:.1f} request lifetimes of arrivals): colocated serves "
            f"{colo.attained:.0%} within both SLOs, the split {disagg.attained:.0%}.")
