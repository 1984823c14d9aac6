"""Serving a list of requests, simulated step by step on the cost model (DistServe's
simulator): each request's TTFT and TPOT, so goodput counts the requests that meet the
SLOs, tails included, instead of pricing the mean request.

A replica runs the engine's iteration-level schedule: each step takes its running
sequences oldest first (a decode token each, or the next chunk of an unfinished prompt)
and then admits waiting ones, up to the step's token budget and `max_seqs`; its time is
the cost model's for that work. A request arriving during a step waits for the next.
Replicas of one kind share arrivals by the least outstanding work. A split runs the
prompts on prefill replicas (the first token), moves each prompt's KV in `hop_s`, and
decodes on decode replicas, where the request starts from its prompt's cached KV.
The KV cache's capacity is not simulated (no preemption).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshserve.parallel.planner.cost_model import StepWork

StepTime = Callable[[StepWork], float]
"""Seconds one step of this work takes (a replica's cost model)."""


@dataclass(frozen=True)
class SimRequest:
    """One request: when it arrives, its prompt and output tokens, and how many of its
    prompt tokens the replica already caches."""

    arrival_s: float
    prompt: int
    output: int
    cached: int = 0


@dataclass(eq=False)
class _Seq:
    index: int
    req: SimRequest
    computed: int = 0
    """Prompt and output tokens whose KV exists (a decoder's: as of its joining)."""
    generated: int = 0
    """Output tokens sampled (a decoder's: as of its joining)."""
    joined: int = 0
    """The replica's decode clock when it began decoding."""

    @property
    def left(self) -> int:
        """Tokens still to compute or generate, as of `computed` and `generated`: the rest
        of its prompt, if any, and of its output."""
        return max(0, self.req.prompt - self.computed) + self.req.output - self.generated


@dataclass
class _Replica:
    """One replica's schedule. Its decoders (sequences past their prompt) are summed, not
    walked: every step runs each of them one token (the budget is at least max_seqs), so
    a step's decode work and the decoders' progress follow from counts and a clock, and
    a decoder is touched only when it joins and when it finishes. At most one sequence
    is part-way through its prompt, and it is the newest running: admissions stop when
    a prompt does not fit."""

    step_s: StepTime
    budget: int
    max_seqs: int
    waiting: deque[_Seq] = field(default_factory=deque)
    filling: list[_Seq] = field(default_factory=list)
    """Running sequences still in their prompt, oldest first (after every decoder)."""
    ends: list[tuple[int, int, _Seq]] = field(default_factory=list)
    """Decoders as (the clock at which they finish, request index, sequence), a heap."""
    clock: int = 0
    """Decode steps this replica has run."""
    context: int = 0
    """Tokens in the decoders' KV, summed."""
    decoders_left: int = 0
    """The decoders' `left`, summed."""
    waiting_left: int = 0
    planned: list[tuple[_Seq, int]] = field(default_factory=list)
    """The step in flight's prompt chunks: each sequence and the tokens it computes."""
    decoding: int = 0
    """Decoders in the step in flight."""
    busy_until: float | None = None

    def __post_init__(self) -> None:
        if self.budget < self.max_seqs:
            raise ValueError(f"budget={self.budget}: allowed is a step budget >= max_seqs "
                             f"({self.max_seqs}), so every decoder runs every step")

    @property
    def outstanding(self) -> int:
        """Tokens still to compute or generate (what the router balances)."""
        return self.waiting_left + self.decoders_left + sum(s.left for s in self.filling)

    def queue(self, s: _Seq) -> None:
        self.waiting.append(s)
        self.waiting_left += s.left

    def start(self, now: float) -> float | None:
        """Plan the next step at `now`; its end, or None with nothing to run."""
        d = len(self.ends)
        left, work, plan = self.budget - d, _Work(), []
        work.tokens = work.seqs = d  # each decoder: one token over its context
        work.kv_read, work.attended = self.context, self.context + d
        for s in self.filling:
            if left <= 0:
                break
            n = min(left, s.req.prompt - s.computed)
            plan.append((s, n))
            work.add(s, n)
            left -= n
        while self.waiting and left > 0 and d + len(self.filling) < self.max_seqs:
            s = self.waiting.popleft()
            self.waiting_left -= s.left
            s.computed = max(s.computed, min(s.req.cached, s.req.prompt - 1))
            n = min(left, s.req.prompt - s.computed)
            self.filling.append(s)
            plan.append((s, n))
            work.add(s, n)
            left -= n
        if not plan and not d:
            self.busy_until = None
            return None
        self.planned, self.decoding = plan, d
        self.busy_until = now + self.step_s(work.total())
        return self.busy_until

    def finish(self, now: float, first: list[float], done: list[float]) -> None:
        """Apply the step that ends at `now`: tokens sampled, sequences finished."""
        if self.decoding:
            self.clock += 1
            self.context += self.decoding
            self.decoders_left -= self.decoding
            while self.ends and self.ends[0][0] <= self.clock:
                _, i, s = heapq.heappop(self.ends)
                done[i] = now
                ran = self.clock - s.joined
                self.context -= s.computed + ran
                self.decoders_left -= s.left - ran
        for s, n in self.planned:
            s.computed += n
            if s.computed < s.req.prompt:
                continue  # a prompt chunk: no token yet
            self.filling.remove(s)
            s.generated = 1
            first[s.index] = now
            if s.generated >= s.req.output:
                done[s.index] = now
                continue
            s.joined = self.clock
            heapq.heappush(self.ends, (self.clock + s.req.output - s.generated, s.index, s))
            self.context += s.computed
            self.decoders_left += s.left
        self.planned, self.decoding = [], 0


@dataclass(slots=True)
class _Work:
    """A step's work, summed as plain counts (a StepWork per sequence costs more than the
    rest of the simulation)."""

    tokens: float = 0.0
    seqs: float = 0.0
    kv_read: float = 0.0
    attended: float = 0.0

    def add(self, s: _Seq, n: int) -> None:
        """Sequence `s` computes a prompt chunk of `n` tokens after its `computed` ones
        (as StepWork.prefill counts it)."""
        c = s.computed
        self.tokens += n
        self.seqs += 1
        self.kv_read += c
        self.attended += n * c + n * (n + 1) / 2

    def total(self) -> StepWork:
        return StepWork(num_new_tokens=self.tokens, num_seqs=self.seqs,
                        num_kv_read=self.kv_read, num_attended=self.attended)


@dataclass(frozen=True)
class SimResult:
    """When each request got its first token and its last (by the requests' order)."""

    first_token_s: list[float]
    finish_s: list[float]


def simulate(requests: Sequence[SimRequest], step_s: StepTime, *, replicas: int = 1,
             budget: int = 2048, max_seqs: int = 256) -> SimResult:
    """Serve `requests` on `replicas` alike replicas (least outstanding work first). At
    most `budget` sequences run at once: a step runs no more decode tokens than that."""
    reps = [_Replica(step_s, budget, min(max_seqs, budget)) for _ in range(replicas)]
    first = [float("nan")] * len(requests)
    done = [float("nan")] * len(requests)
    arrivals = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    ends: list[tuple[float, int]] = []  # (step end, replica)
    a = 0
    while a < len(arrivals) or ends:
        if a < len(arrivals) and (not ends or requests[arrivals[a]].arrival_s <= ends[0][0]):
            i = arrivals[a]
            a += 1
            now = requests[i].arrival_s
            r = min(range(replicas), key=lambda k: reps[k].outstanding)
            reps[r].queue(_Seq(i, requests[i]))
            if reps[r].busy_until is None and (end := reps[r].start(now)) is not None:
                heapq.heappush(ends, (end, r))
            continue
        now, r = heapq.heappop(ends)
        reps[r].finish(now, first, done)
        if (end := reps[r].start(now)) is not None:
            heapq.heappush(ends, (end, r))
    return SimResult(first_token_s=first, finish_s=done)


def simulate_split(requests: Sequence[SimRequest], prefill_step_s: StepTime,
                   decode_step_s: StepTime, *, hop_s: Callable[[SimRequest], float],
                   prefill_replicas: int = 1, decode_replicas: int = 1,
                   prefill_budget: int = 2048, decode_budget: int = 2048,
                   max_seqs: int = 256, prefill_max_seqs: int | None = None) -> SimResult:
    """Prompts on the prefill replicas (the first token), each prompt's KV moved in
    `hop_s(request)`, the rest on the decode replicas from the moved KV (every prompt
    token's, so only the first token is computed before the second comes). `max_seqs` caps
    the decode replicas' batch, and the prefill replicas' too unless `prefill_max_seqs` is
    given."""
    firsts = simulate([SimRequest(r.arrival_s, r.prompt, 1, r.cached) for r in requests],
                      prefill_step_s, replicas=prefill_replicas, budget=prefill_budget,
                      max_seqs=prefill_max_seqs or max_seqs).first_token_s
    later = [SimRequest(f + hop_s(r), r.prompt + 1, r.output - 1, r.prompt)
             for f, r in zip(firsts, requests, strict=True) if r.output > 1]
    rest = simulate(later, decode_step_s, replicas=decode_replicas, budget=decode_budget,
                    max_seqs=max_seqs).finish_s
    it = iter(rest)
    finish = [next(it) if r.output > 1 else f for f, r in zip(firsts, requests, strict=True)]
    return SimResult(first_token_s=firsts, finish_s=finish)


@dataclass(frozen=True)
class Attainment:
    """How a simulated run met the SLOs."""

    goodput_req_s: float
    """Requests meeting both SLOs per second of the run (first arrival to last finish)."""
    ttft_s: list[float]
    tpot_s: list[float]
    """Per request with more than one output token."""
    wall_s: float = 0.0
    """First arrival to last finish."""
    num_good: int = 0
    """Requests that met both SLOs."""

    @property
    def attained(self) -> float:
        """The share of requests that met both SLOs."""
        return self.num_good / len(self.ttft_s) if self.ttft_s else 0.0


def attainment(requests: Sequence[SimRequest], result: SimResult, ttft_slo_s: float,
               tpot_slo_s: float) -> Attainment:
    """Goodput as a benchmark counts it: requests whose TTFT and TPOT meet the SLOs, over
    the run's wall time."""
    ttft, tpot, good = [], [], 0
    for r, f, d in zip(requests, result.first_token_s, result.finish_s, strict=True):
        t = f - r.arrival_s
        ttft.append(t)
        per = (d - f) / (r.output - 1) if r.output > 1 else None
        if per is not None:
            tpot.append(per)
        good += t <= ttft_slo_s and (per is None or per <= tpot_slo_s)
    start = min(r.arrival_s for r in requests)
    wall = max(result.finish_s) - start
    return Attainment(goodput_req_s=good / wall if wall > 0 else 0.0, ttft_s=ttft,
                      tpot_s=tpot, wall_s=wall, num_good=good)


def replica_capacity(request: SimRequest, step_s: StepTime, *, budget: int = 2048,
                     max_seqs: int = 256) -> float:
    """Requests like `request` one replica completes per second when it cannot keep up:
    4 x min(max_seqs, budget) of them arriving at once, the completions from the end of the first
    batch's worth to the end of the third over the time between (alike requests finish
    in waves of a batch each; the first wave's prompts and the emptying last are left
    out). An open system of such replicas is stable only below this rate."""
    seqs = min(max_seqs, budget)
    burst = [SimRequest(0.0, request.prompt, request.output, request.cached)] * (4 * seqs)
    return wave_rate(simulate(burst, step_s, budget=budget, max_seqs=max_seqs).finish_s,
                     seqs)


def wave_rate(finish_s: Sequence[float], seqs: int) -> float:
    """Completions per second from a burst of 4 x `seqs` alike requests on a replica that
    runs `seqs` at once (simulated, or timed on the engine): the 2 x `seqs` from the end
    of the first wave to the end of the third, over the time between."""
    if len(finish_s) < 3 * seqs or seqs < 1:
        raise ValueError(f"{len(finish_s)} finish times: allowed are at least 3 x seqs "
                         f"({3 * seqs})")
    ends = sorted(finish_s)
    span = ends[3 * seqs - 1] - ends[seqs - 1]
    return 2 * seqs / span if span > 0 else math.inf
