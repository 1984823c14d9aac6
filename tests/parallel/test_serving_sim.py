"""The serving simulator: the engine's schedule on a step-time function, per request."""

from __future__ import annotations

import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.parallel.planner.cost_model import StepWork
from meshserve.parallel.planner.serving_sim import (
    SimRequest,
    StepTime,
    attainment,
    replica_capacity,
    simulate,
    simulate_split,
)


def flat(work: StepWork) -> float:
    """Every step takes 1 s, whatever it holds."""
    return 1.0


def per_token(work: StepWork) -> float:
    """1 ms a token run through the layers."""
    return 1e-3 * work.num_new_tokens


def test_one_request_alone_prefills_then_decodes_a_token_a_step() -> None:
    res = simulate([SimRequest(0.0, prompt=10, output=4)], flat)
    assert (res.first_token_s, res.finish_s) == ([1.0], [4.0])


def test_a_prompt_over_the_budget_takes_a_step_per_chunk() -> None:
    res = simulate([SimRequest(0.0, prompt=100, output=1)], flat, budget=32)
    assert res.first_token_s == [4.0]  # 32 + 32 + 32 + 4


def test_a_request_arriving_mid_step_waits_for_the_next() -> None:
    res = simulate([SimRequest(0.0, 10, 3), SimRequest(0.5, 10, 2)], flat)
    # Step 1 (0-1): prompt A. Step 2 (1-2): A decodes, B's prompt joins (first at 2).
    assert res.first_token_s == [1.0, 2.0] and res.finish_s == [3.0, 3.0]


def test_a_full_replica_queues_and_two_replicas_share_the_load() -> None:
    reqs = [SimRequest(0.0, 10, 3), SimRequest(0.0, 10, 3)]
    one = simulate(reqs, flat, max_seqs=1)
    assert one.first_token_s == [1.0, 4.0]  # B starts when A is done
    two = simulate(reqs, flat, replicas=2, max_seqs=1)
    assert two.first_token_s == [1.0, 1.0] and two.finish_s == [3.0, 3.0]


def test_decodes_share_a_step_with_a_chunk_of_the_next_prompt() -> None:
    reqs = [SimRequest(0.0, 8, 5), SimRequest(0.0005, 100, 1)]
    res = simulate(reqs, per_token, budget=20)
    # A's prompt (8 ms); then each step: A's decode + 19 tokens of B's prompt.
    assert res.first_token_s[0] == pytest.approx(0.008)
    assert res.finish_s[0] == pytest.approx(0.008 + 4 * 0.020)


def test_a_split_prefills_there_moves_the_kv_and_decodes_from_the_cached_prompt() -> None:
    seen: list[StepWork] = []

    def decode_side(work: StepWork) -> float:
        seen.append(work)
        return 1.0

    res = simulate_split([SimRequest(0.0, prompt=40, output=3)], flat, decode_side,
                         hop_s=lambda r: 0.25)
    assert res.first_token_s == [1.0]
    # Arrives at 1.25 with every prompt token's KV: computes its first token's and samples
    # token 2 at 2.25, token 3 at 3.25.
    assert res.finish_s == [3.25]
    assert seen[0].num_new_tokens == 1 and seen[0].num_kv_read == 40


def test_attainment_counts_the_requests_within_both_slos() -> None:
    reqs = [SimRequest(0.0, 10, 3), SimRequest(0.0, 10, 3)]
    res = simulate(reqs, flat, max_seqs=1)  # TTFT 1 and 4, TPOT 1 and 1
    att = attainment(reqs, res, ttft_slo_s=2.0, tpot_slo_s=1.0)
    assert att.ttft_s == [1.0, 4.0] and att.tpot_s == [1.0, 1.0]
    assert att.goodput_req_s == pytest.approx(1 / 6)  # one good request over 6 s
    assert attainment(reqs, res, 5.0, 0.5).goodput_req_s == 0.0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 5), st.integers(1, 300), st.integers(1, 20),
                          st.integers(0, 300)), min_size=1, max_size=20),
       st.integers(1, 3), st.integers(1, 64), st.integers(1, 8), st.booleans())
def test_every_request_finishes_after_its_first_token(
        spec: list[tuple[float, int, int, int]], replicas: int, budget: int, max_seqs: int,
        split: bool) -> None:
    reqs = [SimRequest(a, p, o, min(c, p)) for a, p, o, c in spec]
    if split:
        res = simulate_split(reqs, per_token, per_token, hop_s=lambda r: 0.01,
                             prefill_replicas=replicas, prefill_budget=budget,
                             decode_budget=budget, max_seqs=max_seqs)
    else:
        res = simulate(reqs, per_token, replicas=replicas, budget=budget, max_seqs=max_seqs)
    for r, f, d in zip(reqs, res.first_token_s, res.finish_s, strict=True):
        assert not math.isnan(f) and not math.isnan(d)
        assert r.arrival_s < f <= d
        # At most one token a step, each step at least 1 ms a token: the decode takes time.
        assert d - f >= (r.output - 1) * 1e-3 - 1e-9


def reference(requests: list[SimRequest], step_s: StepTime, replicas: int, budget: int,
              max_seqs: int) -> tuple[list[float], list[float]]:
    """The schedule walked sequence by sequence, every step (what simulate() sums)."""
    first = [math.nan] * len(requests)
    done = [math.nan] * len(requests)
    state = [{"waiting": [], "running": [], "plan": [], "busy": None} for _ in range(replicas)]
    progress = {i: [0, 0] for i in range(len(requests))}  # computed, generated

    def outstanding(rep: dict) -> int:
        return sum(max(0, requests[i].prompt - progress[i][0]) + requests[i].output
                   - progress[i][1] for i in rep["waiting"] + rep["running"])

    def start(rep: dict, now: float) -> float | None:
        left, work, plan = budget, StepWork(), []
        for i in rep["running"]:
            if left <= 0:
                break
            c, r = progress[i][0], requests[i]
            n = 1 if c >= r.prompt else min(left, r.prompt - c)
            plan.append((i, n))
            work += StepWork.decode(1, c) if c >= r.prompt else StepWork.prefill(n, c)
            left -= n
        while rep["waiting"] and left > 0 and len(rep["running"]) < max_seqs:
            i = rep["waiting"].pop(0)
            r = requests[i]
            progress[i][0] = max(progress[i][0], min(r.cached, r.prompt - 1))
            n = min(left, r.prompt - progress[i][0])
            rep["running"].append(i)
            plan.append((i, n))
            work += StepWork.prefill(n, progress[i][0])
            left -= n
        rep["plan"] = plan
        rep["busy"] = now + step_s(work) if plan else None
        return rep["busy"]

    def finish(rep: dict, now: float) -> None:
        for i, n in rep["plan"]:
            progress[i][0] += n
            if progress[i][0] < requests[i].prompt:
                continue
            progress[i][1] += 1
            if progress[i][1] == 1:
                first[i] = now
            if progress[i][1] >= requests[i].output:
                done[i] = now
                rep["running"].remove(i)

    ends: list[tuple[float, int]] = []
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    a = 0
    while a < len(order) or ends:
        if a < len(order) and (not ends or requests[order[a]].arrival_s <= ends[0][0]):
            i, a = order[a], a + 1
            now = requests[i].arrival_s
            r = min(range(replicas), key=lambda k: outstanding(state[k]))
            state[r]["waiting"].append(i)
            if state[r]["busy"] is None and (end := start(state[r], now)) is not None:
                heapq.heappush(ends, (end, r))
            continue
        now, r = heapq.heappop(ends)
        finish(state[r], now)
        if (end := start(state[r], now)) is not None:
            heapq.heappush(ends, (end, r))
    return first, done


def costly(work: StepWork) -> float:
    """A step's time grows with everything it computes and reads."""
    return (1e-3 + 1e-4 * work.num_new_tokens + 1e-6 * work.num_kv_read
            + 1e-8 * work.num_attended + 1e-5 * work.num_seqs)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(1, 300), st.integers(1, 40),
                          st.integers(0, 300)), min_size=1, max_size=40),
       st.integers(1, 3), st.sampled_from([(16, 4), (64, 8), (512, 256), (40, 40)]))
def test_summed_decoders_match_the_schedule_walked_per_sequence(
        reqs: list[tuple[float, int, int, int]], replicas: int,
        limits: tuple[int, int]) -> None:
    requests = [SimRequest(t, p, o, min(c, p)) for t, p, o, c in reqs]
    budget, max_seqs = limits
    got = simulate(requests, costly, replicas=replicas, budget=budget, max_seqs=max_seqs)
    first, done = reference(requests, costly, replicas, budget, max_seqs)
    assert got.first_token_s == first and got.finish_s == done


def test_replica_capacity_counts_the_waves_of_a_full_batch() -> None:
    # two at a time: one step for both prompts, two decode steps; a wave every 3 s
    rate = replica_capacity(SimRequest(0.0, 10, 3), flat, budget=100, max_seqs=2)
    assert rate == pytest.approx(2 / 3)
    # one token a step and a budget of 4: the budget caps the batch at 4
    assert replica_capacity(SimRequest(0.0, 1, 5), flat, budget=4, max_seqs=256) \
        == pytest.approx(4 / 5)


def test_the_router_sends_a_request_to_the_idle_replica() -> None:
    """A decoder owes its remaining output, never less than nothing: a replica still
    decoding a long output is busier than an idle one."""
    res = simulate([SimRequest(0.0, 10, 400), SimRequest(250.5, 10, 400)], flat,
                   replicas=2, max_seqs=1)
    assert res.first_token_s == [1.0, 251.5]
