"""A sized layout serving a list of requests, simulated on its cost model: colocated and
split, the KV hop on the link the split's ranks share, and what the sizing rejects."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshserve.launch.cli_config import load_config
from meshserve.launch.plan import model_shape
from meshserve.parallel.planner.layout_sim import (
    Replicas,
    capacity_colocated,
    hop_bytes_s,
    hop_link,
    hop_tokens,
    kv_hop,
    profile_scale,
    scenario_requests,
    simulate_colocated,
    simulate_disagg,
    steady_requests,
    step_time,
)
from meshserve.parallel.planner.rate_search import max_rate
from meshserve.parallel.planner.search import options_for, sized
from meshserve.parallel.planner.serving_sim import SimRequest, attainment, simulate


def setup(*overrides: str):  # noqa: ANN201
    cfg = load_config(["cluster=dgx-h100", "scenario=rag", *overrides])
    return model_shape(cfg, cfg.cluster), cfg.cluster, cfg.scenario, options_for(cfg)


REQUESTS = [SimRequest(0.05 * i, 1000 + 100 * (i % 5), 64) for i in range(40)]


def test_one_colocated_replica_is_the_cost_model_stepped_through_the_requests() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-8b")
    att = simulate_colocated(shape, cluster, scenario, options, Replicas(tp=2), REQUESTS)
    cost = sized(shape, cluster, scenario, 2, 1, options)[1]
    assert att is not None and cost is not None
    direct = attainment(REQUESTS, simulate(REQUESTS, step_time(cost)),
                        scenario.ttft_slo_ms / 1e3, scenario.tpot_slo_ms / 1e3)
    assert att == direct
    assert len(att.ttft_s) == len(REQUESTS) and all(t > 0 for t in att.ttft_s)


def test_more_replicas_cut_the_queue() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-8b")
    burst = [SimRequest(0.002 * i, 1000 + 100 * (i % 5), 64) for i in range(40)]
    one = simulate_colocated(shape, cluster, scenario, options, Replicas(), burst)
    four = simulate_colocated(shape, cluster, scenario, options, Replicas(count=4), burst)
    assert one is not None and four is not None
    assert max(four.ttft_s) < max(one.ttft_s) / 2


def test_the_hop_takes_the_inter_node_link_once_the_split_leaves_the_node() -> None:
    shape, cluster, _, _ = setup("model=llama-3-8b")
    r = SimRequest(0.0, 2000, 64, cached=500)
    inside = kv_hop(shape, cluster, Replicas(tp=4), Replicas(tp=4))(r)
    across = kv_hop(shape, cluster, Replicas(tp=8), Replicas(tp=8))(r)
    assert across > inside > 0  # InfiniBand is slower than NVLink
    # The cached prefix does not move; two pairs of ranks halve each one's bytes.
    whole = kv_hop(shape, cluster, Replicas(), Replicas())(dataclasses.replace(r, cached=0))
    part = kv_hop(shape, cluster, Replicas(), Replicas())(r)
    pairs = kv_hop(shape, cluster, Replicas(tp=2), Replicas(tp=2))(r)
    assert part < whole and pairs < part


@given(st.integers(0, 10_000), st.integers(1, 4096), st.integers(1, 80))
def test_a_streamed_prompt_leaves_only_its_last_steps_last_layer_for_after_the_first_token(
        tokens: int, step: int, layers: int) -> None:
    left = hop_tokens(tokens, step, layers)
    assert hop_tokens(tokens, None, layers) == tokens
    if tokens == 0:
        assert left == 0
        return
    last = round(left * layers)
    assert 1 <= last <= min(tokens, step)
    assert (tokens - last) % step == 0  # whole steps went before it


def test_a_streamed_hop_prices_the_last_steps_kv_and_a_pipelined_prefill_streams_none(
        ) -> None:
    shape, cluster, _, _ = setup("model=llama-3-8b")
    r = SimRequest(0.0, 3000, 64, cached=500)  # 2,500 to move: steps of 1,024, 1,024, 452
    link = hop_link(2, cluster)
    streamed = kv_hop(shape, cluster, Replicas(budget=1024), Replicas(), streamed=True)(r)
    assert streamed == hop_bytes_s(shape, cluster, link, 452 / 32, 1)[1]  # its last layer
    whole = kv_hop(shape, cluster, Replicas(budget=1024), Replicas())(r)
    assert whole == hop_bytes_s(shape, cluster, link, 2500, 1)[1] > streamed
    piped = Replicas(pp=2, budget=1024)
    assert kv_hop(shape, cluster, piped, Replicas(), streamed=True)(r) \
        == kv_hop(shape, cluster, piped, Replicas())(r)


def test_a_split_answers_first_from_the_prefill_side_and_decodes_after_the_hop() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-8b")
    att = simulate_disagg(shape, cluster, scenario, options, Replicas(tp=2), Replicas(tp=2),
                          REQUESTS)
    colo = simulate_colocated(shape, cluster, scenario, options, Replicas(tp=2, count=2),
                              REQUESTS)
    assert att is not None and colo is not None
    assert len(att.tpot_s) == len(REQUESTS)
    # Decode replicas run no prompt beside the decodes: the worst TPOT is lower.
    assert max(att.tpot_s) < max(colo.tpot_s)


def test_a_replica_the_sizing_rejects_simulates_nothing() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-70b")
    assert simulate_colocated(shape, cluster, scenario, options, Replicas(), REQUESTS) is None
    assert simulate_disagg(shape, cluster, scenario, options, Replicas(), Replicas(tp=4),
                           REQUESTS) is None
    assert simulate_colocated(shape, cluster, scenario, options, Replicas(tp=4),
                              REQUESTS) is not None


@pytest.mark.parametrize("count", [1, 3])
def test_every_request_gets_its_figures(count: int) -> None:
    shape, cluster, scenario, options = setup("model=llama-3-8b")
    att = simulate_colocated(shape, cluster, scenario, options, Replicas(count=count),
                             REQUESTS)
    assert att is not None and 0 < att.goodput_req_s <= len(REQUESTS) / 1.95


def test_a_profile_twice_as_slow_as_priced_doubles_the_simulated_steps() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-8b")
    burst = [SimRequest(0.0, 1500, 32) for _ in range(4)]
    priced = simulate_colocated(shape, cluster, scenario, options, Replicas(), burst)
    assert priced is not None and priced.wall_s > 0
    scale = profile_scale(2 * priced.wall_s, priced)
    assert scale == pytest.approx(2.0)
    slow = simulate_colocated(shape, cluster, scenario, options, Replicas(), burst, scale)
    assert slow is not None
    assert slow.wall_s == pytest.approx(2 * priced.wall_s)  # a burst: every step scaled
    assert max(slow.ttft_s) == pytest.approx(2 * max(priced.ttft_s))
    with pytest.raises(ValueError, match="ran nothing"):
        profile_scale(1.0, dataclasses.replace(priced, wall_s=0.0))


def test_scenario_requests_arrive_as_a_poisson_process_of_the_scenarios_lengths() -> None:
    _, _, scenario, _ = setup("model=llama-3-8b", "scenario.shared_prefix_fraction=0.25")
    reqs = scenario_requests(scenario, 4.0, 2000, seed=1)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert all(g >= 0 for g in gaps) and sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    assert {(r.prompt, r.output, r.cached) for r in reqs} == {
        (scenario.prompt_len, scenario.output_len, scenario.prompt_len // 4)}
    assert scenario_requests(scenario, 4.0, 5, seed=1) == reqs[:5]  # seeded
    with pytest.raises(ValueError, match="rate=0"):
        scenario_requests(scenario, 0.0, 5)


def test_steady_requests_span_several_lifetimes_within_bounds() -> None:
    assert steady_requests(10.0, 30.0) == 900  # 3 lifetimes of 30 s at 10 req/s
    assert steady_requests(0.1, 1.0) == 200 and steady_requests(1e3, 60.0) == 2000
    assert steady_requests(1.0, math.inf) == 2000
    with pytest.raises(ValueError, match="lifetime_s=nan"):
        steady_requests(1.0, math.nan)
    with pytest.raises(ValueError, match="rate=0"):
        steady_requests(0.0, 1.0)


def test_a_burst_shorter_than_a_lifetime_overstates_what_a_layout_serves() -> None:
    """Requests that all fit in one batch at once meet the SLOs; the same rate kept up
    for several lifetimes queues: why the planner's check spans steady_requests."""
    shape, cluster, scenario, options = setup("model=llama-3-70b", "cluster=dgx-h200",
                                              "scenario=codegen")
    scenario = dataclasses.replace(scenario, prompt_len=1024, output_len=512)
    layout = Replicas(2, 1, 4, options.max_num_batched_tokens)
    rate = 120.0  # about 4x what the layout completes at saturation
    assert capacity_colocated(shape, cluster, scenario, options, layout) < rate / 3
    burst = simulate_colocated(shape, cluster, scenario, options, layout,
                               scenario_requests(scenario, rate, 200))
    steady = simulate_colocated(shape, cluster, scenario, options, layout,
                                scenario_requests(scenario, rate, 2000))
    assert burst is not None and steady is not None
    assert burst.attained >= 0.9 and steady.attained < 0.5


@given(st.floats(1e-2, 1e3), st.floats(-2.0, 2.0), st.sampled_from([0.01, 0.05, 0.2]))
def test_max_rate_brackets_the_edge_of_a_monotone_predicate(guess: float, log_ratio: float,
                                                            tol: float) -> None:
    edge = guess * 10**log_ratio  # within the search's reach (guess / 1e3 to guess x 1e3)
    asked: list[float] = []

    def served(rate: float) -> bool:
        asked.append(rate)
        return rate <= edge

    found = max_rate(served, guess, rel_tol=tol)
    assert edge / (1 + tol) <= found <= edge
    doublings = abs(math.log2(edge / guess)) + 1
    bisections = math.log2(math.log(2) / math.log1p(tol)) + 1
    assert len(asked) <= doublings + bisections + 2


def test_max_rate_edges() -> None:
    assert max_rate(lambda r: False, 1.0) == 0.0
    assert max_rate(lambda r: True, 1.0) >= 1e3
    with pytest.raises(ValueError, match="guess=0"):
        max_rate(lambda r: True, 0.0)


def test_a_replica_runs_no_more_sequences_than_its_kv_cache_and_the_scenario_allow() -> None:
    """70B at tp=2 on an 80 GB H100 keeps a few GB for KV: a handful of 1.5k-token
    requests at once, as the closed forms count it; on a 141 GB H200, the scenario's cap."""
    small = setup("model=llama-3-70b", "cluster=dgx-h100", "scenario=codegen",
                  "scenario.prompt_len=1024", "scenario.output_len=512")
    large = setup("model=llama-3-70b", "cluster=dgx-h200", "scenario=codegen",
                  "scenario.prompt_len=1024", "scenario.output_len=512")
    layout = Replicas(2, 1, 1, 2048)
    few = capacity_colocated(*small, layout)
    many = capacity_colocated(*large, layout)
    assert 0 < few and many > 10 * few
