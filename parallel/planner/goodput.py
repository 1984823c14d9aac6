"""Goodput in closed form: the highest Poisson rate at which ATTAINMENT of the requests
meet both SLOs, with the tails that decide it priced (tails.py), not the mean request.

A colocated replica at arrival rate r:
  - TTFT: the prompt alone, one step, and its wait behind earlier prompts (the replicas'
    one queue, each prompt's prefill the service: M/D/c);
  - TPOT: a request decodes beside j others (Poisson, mean r x its decode life), each
    step the cost of that batch, and is stalled by every prompt prefilled before it ends
    (stalls_within), each by what its chunks add to the steps they ride in; it meets the
    SLO while those stalls fit its budget, (o - 1) x (SLO - step).
A split: its prefill replicas' queue, and its decode replicas' batches alone (no prompt
stalls them), the KV hop spread over the output.
The shares are taken as independent: a rate is served where their product reaches
ATTAINMENT.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache

from meshserve.parallel.planner.cost_model import CostModel, StepWork
from meshserve.parallel.planner.rate_search import max_rate
from meshserve.parallel.planner.scenario import ScenarioConfig
from meshserve.parallel.planner.tails import stalls_within, wait_within

ATTAINMENT = 0.9
"""The share of requests within both SLOs at which a rate counts as served (DistServe's
attainment target): a layout's goodput is the highest such rate."""
BATCH_SDS = 6.0
"""A decode batch's others are summed this many standard deviations either side of their
mean (Poisson weights beyond are negligible)."""


def attained_rate(share: Callable[[float], float], *, upper: float) -> float:
    """The highest rate below `upper` at which `share(rate)` (falling with the rate) reaches
    ATTAINMENT, to within 0.1%; 0 where even a vanishing rate misses it."""
    return max_rate(lambda rate: rate < upper and share(rate) >= ATTAINMENT, upper / 2,
                    rel_tol=1e-3, floor=1e-6)


def context_of(scenario: ScenarioConfig) -> float:
    """The mean context a decode step reads per sequence."""
    return scenario.prompt_len + scenario.output_len / 2


class DecodeTail:
    """One replica's decoders at arrival rate r: the share within the TPOT SLO. With
    `prompts` (colocated serving) every prompt the replica prefills stalls them by what
    its chunks add to the steps they ride in (`stall_s`); `extra_s` is added to every
    request's decode (a split's KV hop)."""

    def __init__(self, cost: CostModel, scenario: ScenarioConfig, largest: int, *,
                 prompts: bool = False, cached: int = 0, step_tokens: int = 2048,
                 extra_s: float = 0.0) -> None:
        self.scenario, self.largest, self.prompts = scenario, largest, prompts
        self.extra_s = extra_s
        context = context_of(scenario)
        self.step_s: Callable[[int], float] = cache(lambda b: cost.tpot_s(b, context))

        @cache
        def stall_s(batch: int) -> float:
            """What one prompt's chunks add to the steps of `batch` decodes they ride in; in
            a pipeline, its prefill's time on the slowest stage (what the prompt costs a
            busy pipeline: a round's micro-batches change with the sequences in it)."""
            if cost.layout.pp > 1:
                return cost.prefill_busy_s(scenario.prompt_len, cached)
            decode = StepWork.decode(batch, context)
            alone, chunk = cost.step(decode).total_s, max(1, step_tokens - batch)
            added, done = 0.0, cached
            while done < scenario.prompt_len:
                n = min(chunk, scenario.prompt_len - done)
                added += cost.step(decode + StepWork.prefill(n, done)).total_s - alone
                done += n
            return added

        self.stall_s: Callable[[int], float] = stall_s
        self.others: Callable[[float], float] = cache(self._others)

    def load(self, rate: float, batch: int) -> float:
        """The share of the replica's time prompts take at `rate`."""
        return rate * self.stall_s(batch) if self.prompts else 0.0

    def _others(self, rate: float) -> float:
        """Mean sequences decoding beside one (Little: rate x decode life), the life
        stretched by the prompts prefilled meanwhile; inf where they never settle."""
        o = self.scenario.output_len
        others = 0.0
        for _ in range(50):
            batch = min(self.largest, 1 + math.ceil(others))
            load = self.load(rate, batch)
            if load >= 1:
                return math.inf
            nxt = rate * (o - 1) * self.step_s(batch) / (1 - load)
            if abs(nxt - others) < 1e-3:
                break
            others = nxt
        return others

    def share(self, rate: float) -> float:
        """The share of requests within the TPOT SLO at arrival rate `rate`."""
        o, slo = self.scenario.output_len, self.scenario.tpot_slo_ms / 1e3
        others = self.others(rate)
        if others + 1 > self.largest:  # requests queue for a decode slot for good
            return 0.0
        if o <= 1:
            return 1.0
        spread = BATCH_SDS * math.sqrt(others)
        total = 0.0
        for j in range(max(0, math.floor(others - spread)), math.ceil(others + spread) + 1):
            weight = math.exp(-others + j * math.log(others) - math.lgamma(j + 1)) \
                if others > 0 else float(j == 0)
            batch = min(self.largest, 1 + j)  # more wait for a slot
            step = self.step_s(batch)
            budget = (o - 1) * (slo - step) - self.extra_s
            if budget < 0:
                continue
            if not self.prompts:
                total += weight
                continue
            stall = self.stall_s(batch)
            starts = rate * ((o - 1) * step + stall)  # during its life and its own prompt
            total += weight * stalls_within(budget / stall, starts, self.load(rate, batch))
        return min(1.0, total)


def colocated_goodput(cost: CostModel, scenario: ScenarioConfig, *, dp: int, largest: int,
                      cached: int = 0, step_tokens: int = 2048) -> float:
    """Requests/s `dp` colocated replicas serve with ATTAINMENT within both SLOs (each
    replica's decode batch at most `largest`, its steps at most `step_tokens`)."""
    decode = DecodeTail(cost, scenario, largest, prompts=True, cached=cached,
                        step_tokens=step_tokens)
    alone = cost.ttft_s(scenario.prompt_len, cached)
    ttft_slo = scenario.ttft_slo_ms / 1e3

    def share(rate: float) -> float:
        r = rate / dp
        others = decode.others(r)
        if others + 1 > largest:
            return 0.0
        batch = min(largest, 1 + math.ceil(others))
        step = decode.step_s(batch)
        service = decode.stall_s(batch) + step  # a prompt's hold on the queue of prompts
        return (wait_within(ttft_slo - alone - step, rate, service, dp)
                * decode.share(r))

    return attained_rate(share, upper=dp / decode.stall_s(1))
