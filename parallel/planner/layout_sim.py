"""A layout the planner sizes, serving a given list of requests, simulated step by step on
its cost model (serving_sim.py): the goodput within SLOs a benchmark of that very
workload should measure, queueing and tails included, where the search's closed forms
price the scenario's mean request.

Colocated: `dp` alike replicas of tp x pp, each step priced by the cost model (a pipeline
replica runs one round at a time). Split: prefill replicas run the prompts and give the
first token, each prompt's KV crosses the link the split's ranks share (every rank pair
moving its own piece), decode replicas run the rest from the moved KV.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.cost_model import CostModel, StepWork, link_figures, p2p_s
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.prediction import cached_tokens
from meshserve.parallel.planner.scenario import ScenarioConfig
from meshserve.parallel.planner.search import PlannerOptions, sized
from meshserve.parallel.planner.serving_sim import (
    Attainment,
    SimRequest,
    attainment,
    replica_capacity,
    simulate,
    simulate_split,
)


@dataclass(frozen=True)
class Replicas:
    """`count` replicas of tp x pp, each stepping with a budget of `budget` tokens."""

    tp: int = 1
    pp: int = 1
    count: int = 1
    budget: int = 2048

    @property
    def ranks(self) -> int:
        return self.tp * self.pp


def scenario_requests(scenario: ScenarioConfig, rate: float, num: int, seed: int = 0
                      ) -> list[SimRequest]:
    """`num` requests of the scenario's prompt and output lengths (its shared prefix
    cached) arriving as a Poisson process at `rate` requests/s."""
    if rate <= 0:
        raise ValueError(f"rate={rate}: allowed is a rate > 0 requests/s")
    rng = random.Random(seed)
    cached = cached_tokens(scenario)
    t, out = 0.0, []
    for _ in range(num):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, scenario.prompt_len, scenario.output_len, cached))
    return out


def steady_requests(rate: float, lifetime_s: float, lifetimes: float = 3.0,
                    least: int = 200, most: int = 2000) -> int:
    """How many Poisson arrivals at `rate` span `lifetimes` lifetimes of a request
    (`lifetime_s`: arrival to last token), within [`least`, `most`]. Fewer requests than
    a lifetime's worth all run at once, a burst the batch absorbs, and a simulation of
    them overstates what the layout serves in its steady state."""
    if not rate > 0 or not lifetime_s >= 0:
        raise ValueError(f"rate={rate}, lifetime_s={lifetime_s}: allowed are a rate > 0 "
                         "and a lifetime >= 0")
    span = rate * lifetime_s * lifetimes
    return most if span >= most else max(least, math.ceil(span))


def step_time(cost: CostModel, scale: float = 1.0) -> Callable[[StepWork], float]:
    """Seconds a step of this work takes on the replica the cost model prices, times
    `scale` (what a profile of the engine found the model's steps to take against the
    cost model's price: `profile_scale`)."""
    return lambda work: scale * cost.step(work).total_s


def profile_scale(measured_wall_s: float, simulated: Attainment) -> float:
    """How much slower the engine ran a profile than the cost model priced it: the
    profile's measured wall time (first arrival to last finish) over the simulation's of
    the same requests on the same layout at scale 1. A burst of requests keeps every step
    busy, so the wall time is the steps' sum and scales with them."""
    if simulated.wall_s <= 0:
        raise ValueError(f"simulated wall time {simulated.wall_s}: the profile ran nothing")
    return measured_wall_s / simulated.wall_s


def hop_link(num_ranks: int, cluster: ClusterConfig) -> str:
    """The link a split's KV hop crosses: intra when all `num_ranks` ranks of its prefill
    and decode replicas sit on one node, else inter (prefill replicas are placed first,
    so some prefill/decode pair then crosses nodes)."""
    return "intra" if num_ranks <= cluster.devices_per_node else "inter"


def hop_bytes_s(shape: ModelShape, cluster: ClusterConfig, link: str, tokens: float,
                lanes: int) -> tuple[float, float]:
    """(bytes, seconds) of moving `tokens` tokens' KV over `link`, `lanes` rank pairs each
    moving its own piece at once."""
    nbytes = tokens * shape.num_layers * shape.kv_bytes_per_token(1)
    return nbytes, p2p_s(nbytes / lanes, *link_figures(cluster, link))


def hop_tokens(tokens: int, step_tokens: int | None, num_layers: int = 1) -> float:
    """Of a prompt's `tokens` uncached tokens, those whose KV moves after its first token
    (in tokens' worth of every layer): all, or, read layer by layer as its prefill steps
    of `step_tokens` compute it, the last layer of the last step's (the wire keeps up with
    the layers before)."""
    if step_tokens is None or tokens <= 0:
        return tokens
    return (tokens - step_tokens * ((tokens - 1) // step_tokens)) / num_layers


def kv_hop(shape: ModelShape, cluster: ClusterConfig, prefill: Replicas, decode: Replicas,
           streamed: bool = False) -> Callable[[SimRequest], float]:
    """Seconds a request's uncached prompt KV takes from a prefill replica to a decode one
    after its first token, as many rank pairs as the smaller side has ranks moving a piece
    each; `streamed`: only its last prefill step's last layer (a pipelined prefill side
    streams nothing)."""
    link = hop_link(prefill.ranks * prefill.count + decode.ranks * decode.count, cluster)
    lanes = min(prefill.ranks, decode.ranks)
    step = prefill.budget if streamed and prefill.pp == 1 else None
    return lambda r: hop_bytes_s(shape, cluster, link, hop_tokens(
        r.prompt - r.cached, step, shape.num_layers), lanes)[1]


MAX_SEQS = 256
"""The engine's default max_num_seqs: a replica's batch when nothing smaller caps it."""


@dataclass(frozen=True)
class _Sized:
    """One replica as the planner sizes it: its cost model, and the most sequences of the
    scenario's lengths it runs at once (the scenario's max_batch and what its KV cache
    holds, as the closed forms cap the batch)."""

    cost: CostModel
    max_seqs: int


def _sized(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
           options: PlannerOptions, replicas: Replicas, tokens_per_seq: int,
           max_batch: int | None = None) -> _Sized | None:
    """`tokens_per_seq`: KV a sequence holds at most; `max_batch`: a cap besides the KV
    cache's (None: MAX_SEQS)."""
    sizing, cost = sized(shape, cluster, scenario, replicas.tp, replicas.pp, options)
    if cost is None:
        return None
    fits = sizing.kv_capacity_tokens // max(1, tokens_per_seq)
    return _Sized(cost, max(1, min(MAX_SEQS if max_batch is None else max_batch, fits)))


def _colocated(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
               options: PlannerOptions, replicas: Replicas) -> _Sized | None:
    return _sized(shape, cluster, scenario, options, replicas,
                  scenario.prompt_len + scenario.output_len, scenario.max_batch)


def _split(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
           options: PlannerOptions, prefill: Replicas, decode: Replicas
           ) -> tuple[_Sized, _Sized] | None:
    """The prefill side holds each prompt (and its first token) until the hop; the decode
    side, whole requests in a batch the scenario caps."""
    pre = _sized(shape, cluster, scenario, options, prefill, scenario.prompt_len + 1)
    dec = _colocated(shape, cluster, scenario, options, decode)
    return None if pre is None or dec is None else (pre, dec)


def simulate_colocated(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                       options: PlannerOptions, replicas: Replicas,
                       requests: Sequence[SimRequest], scale: float = 1.0
                       ) -> Attainment | None:
    """The colocated layout serving `requests` within the scenario's SLOs, its steps at
    `scale` times the cost model's price, each replica's batch capped as the closed forms
    cap it; None where the planner's sizing rejects a replica."""
    rep = _colocated(shape, cluster, scenario, options, replicas)
    if rep is None:
        return None
    res = simulate(requests, step_time(rep.cost, scale), replicas=replicas.count,
                   budget=replicas.budget, max_seqs=rep.max_seqs)
    return attainment(requests, res, scenario.ttft_slo_ms / 1e3, scenario.tpot_slo_ms / 1e3)


def simulate_disagg(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                    options: PlannerOptions, prefill: Replicas, decode: Replicas,
                    requests: Sequence[SimRequest], scale: float = 1.0
                    ) -> Attainment | None:
    """The prefill/decode split serving `requests` within the scenario's SLOs, its steps
    at `scale` times the cost model's price (the KV hop as priced); None where the
    planner's sizing rejects either side's replica."""
    sides = _split(shape, cluster, scenario, options, prefill, decode)
    if sides is None:
        return None
    pre, dec = sides
    res = simulate_split(requests, step_time(pre.cost, scale), step_time(dec.cost, scale),
                         hop_s=kv_hop(shape, cluster, prefill, decode, options.streamed_hop),
                         prefill_replicas=prefill.count, decode_replicas=decode.count,
                         prefill_budget=prefill.budget, decode_budget=decode.budget,
                         max_seqs=dec.max_seqs, prefill_max_seqs=pre.max_seqs)
    return attainment(requests, res, scenario.ttft_slo_ms / 1e3, scenario.tpot_slo_ms / 1e3)


def capacity_colocated(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                       options: PlannerOptions, replicas: Replicas) -> float:
    """Requests of the scenario's lengths the colocated layout completes per second at
    saturation (serving_sim.replica_capacity, times the replicas); 0 where the sizing
    rejects a replica. No arrival rate above it is served for long."""
    rep = _colocated(shape, cluster, scenario, options, replicas)
    if rep is None:
        return 0.0
    req = SimRequest(0.0, scenario.prompt_len, scenario.output_len, cached_tokens(scenario))
    return replicas.count * replica_capacity(req, step_time(rep.cost), budget=replicas.budget,
                                             max_seqs=rep.max_seqs)


def capacity_disagg(shape: ModelShape, cluster: ClusterConfig, scenario: ScenarioConfig,
                    options: PlannerOptions, prefill: Replicas, decode: Replicas) -> float:
    """The same for a split: the lower of its prefill side's rate (prompts to their first
    token) and its decode side's (the rest, from the moved KV)."""
    sides = _split(shape, cluster, scenario, options, prefill, decode)
    if sides is None:
        return 0.0
    pre, dec = sides
    p, o = scenario.prompt_len, scenario.output_len
    prompts = prefill.count * replica_capacity(
        SimRequest(0.0, p, 1, cached_tokens(scenario)), step_time(pre.cost),
        budget=prefill.budget, max_seqs=pre.max_seqs)
    if o <= 1:
        return prompts
    rest = SimRequest(0.0, p + 1, o - 1, p)  # every prompt token's KV moved
    return min(prompts, decode.count * replica_capacity(rest, step_time(dec.cost),
                                                        budget=decode.budget,
                                                        max_seqs=dec.max_seqs))
