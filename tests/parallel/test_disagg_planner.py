"""The prefill/decode split search: the queue model, every split of the devices, the KV hop
priced on its link, and the choice between split and colocated serving."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from meshserve.launch.cli_config import load_config
from meshserve.launch.plan import model_shape
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.disagg_search import (
    SIM_SPLITS,
    choose_kind,
    describe,
    last_true,
    simulated_goodput,
    splits,
)
from meshserve.parallel.planner.goodput import ATTAINMENT
from meshserve.parallel.planner.layout_sim import (
    Replicas,
    capacity_disagg,
    scenario_requests,
    simulate_disagg,
)
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.scenario import ScenarioConfig
from meshserve.parallel.planner.search import metric, options_for


def setup(*overrides: str) -> tuple[ModelShape, ClusterConfig, ScenarioConfig, object]:
    cfg = load_config(list(overrides))
    return model_shape(cfg, cfg.cluster), cfg.cluster, cfg.scenario, options_for(cfg)


LONG_PROMPTS_TIGHT_TPOT = ("model=llama-3-70b", "cluster=dgx-h100", "scenario=rag",
                           "scenario.prompt_len=4000", "scenario.shared_prefix_fraction=0",
                           "scenario.output_len=256", "scenario.ttft_slo_ms=4000",
                           "scenario.tpot_slo_ms=20")


@given(st.integers(0, 200), st.integers(0, 200))
def test_last_true_bisects_a_monotone_predicate(n: int, edge: int) -> None:
    assert last_true(n, lambda b: b <= edge) == min(n, edge)


def test_every_split_uses_every_device_and_prices_its_hop() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-8b", "cluster=dgx-h100",
                                              "scenario=rag")
    found = splits(shape, cluster, scenario, options)
    ok = [c for c in found if c.rejected is None]
    assert ok and all(c.prefill.devices + c.decode.devices == 8 for c in found)
    assert all(c.link == "intra" for c in ok)  # one node
    kv = (scenario.prompt_len - int(scenario.prompt_len * scenario.shared_prefix_fraction)) \
        * shape.num_layers * shape.kv_bytes_per_token(1)
    assert {c.kv_bytes for c in ok} == {kv}
    # every rank pair moves its own piece: twice the ranks on both sides, half the hop
    one = next(c for c in ok if (c.prefill.tp, c.decode.tp, c.prefill.replicas) == (1, 1, 4))
    two = next(c for c in ok if (c.prefill.tp, c.decode.tp, c.prefill.replicas) == (2, 2, 2))
    assert two.transfer_ms < one.transfer_ms
    for c in ok:
        p = c.prediction
        assert p is not None
        # both sides must hold the rate at once: never more than the slower side alone
        assert 0 < p.goodput_req_s <= min(c.prefill_capacity_req_s,
                                          c.decode_capacity_req_s) * 1.002
        assert c.bound_by in ("prefill", "decode")


def test_a_hop_between_nodes_is_priced_on_the_slower_link() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-70b", "cluster=dgx-h100-2node",
                                              "scenario=rag")
    ok = [c for c in splits(shape, cluster, scenario, options) if c.rejected is None]
    assert ok and all(c.link == "inter" for c in ok)  # 16 devices never share one node
    one_node = dataclasses.replace(cluster, num_nodes=1, devices_per_node=16,
                                   nvlink_domain_size=8)
    same = [c for c in splits(shape, one_node, scenario, options) if c.rejected is None]
    pick = {(c.prefill.text, c.decode.text): c for c in same}
    for c in ok[:5]:
        twin = pick[(c.prefill.text, c.decode.text)]
        assert twin.link == "intra" and twin.transfer_ms < c.transfer_ms


def test_a_streamed_split_prices_only_the_last_prefill_steps_hop() -> None:
    """With the prompt read as it is computed (disagg.stream_kv, either connector), a
    4,000-token prompt in steps of 2,048 leaves the last layer of 1,952 tokens' KV for after
    its first token; the bytes are the same. With stream_kv=false it all moves after."""
    found = {}
    for extra in ("disagg.connector=nixl", "disagg.connector=torch",
                  "disagg.stream_kv=false"):
        cfg = load_config([*LONG_PROMPTS_TIGHT_TPOT, extra])
        options = options_for(cfg)
        assert options.streamed_hop == (extra != "disagg.stream_kv=false")
        shape = model_shape(cfg, cfg.cluster)
        found[extra] = {(c.prefill.text, c.decode.text): c
                        for c in splits(shape, cfg.cluster, cfg.scenario, options)
                        if c.rejected is None and c.prefill.pp == 1}
    nixl, torch_, off = found.values()
    assert nixl.keys() == torch_.keys() == off.keys()
    for key, c in nixl.items():
        assert c.kv_bytes == torch_[key].kv_bytes == off[key].kv_bytes
        assert torch_[key].transfer_ms == c.transfer_ms < off[key].transfer_ms
        assert "of it after the first token" in describe(c, cfg.scenario)


def test_memory_rules_reject_a_phase_that_does_not_fit() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-70b", "cluster=dgx-h100",
                                              "scenario=rag")
    found = splits(shape, cluster, scenario, options)
    one_gpu = [c for c in found if c.prefill.tp * c.prefill.pp == 1]
    assert one_gpu and all(c.rejected and c.rejected.startswith("prefill: weights")
                           for c in one_gpu)


def test_long_prompts_under_a_tight_tpot_slo_split() -> None:
    shape, cluster, scenario, options = setup(*LONG_PROMPTS_TIGHT_TPOT)
    choice = choose_kind(shape, cluster, scenario, options)
    assert choice.kind == "disaggregated"
    split, colocated = choice.split, choice.colocated.candidates[0]
    assert split is not None and split.prediction is not None
    assert metric(split, scenario) > 1.1 * metric(colocated, scenario)
    assert split.prediction.tpot_ms <= scenario.tpot_slo_ms
    assert "so the split wins" in choice.explanation


def test_short_chats_stay_colocated() -> None:
    shape, cluster, scenario, options = setup("model=llama-3-8b", "cluster=dgx-h100",
                                              "scenario=chatbot")
    choice = choose_kind(shape, cluster, scenario, options)
    assert choice.kind == "colocated" and choice.split is not None
    assert "colocated" in choice.explanation


def test_a_split_the_run_cannot_start_is_turned_down() -> None:
    shape, cluster, scenario, options = setup(*LONG_PROMPTS_TIGHT_TPOT)
    choice = choose_kind(shape, cluster, scenario, options,
                         accept=lambda c: "one rank each" if c.prefill.tp > 1 else None)
    assert all(c.prefill.tp == 1 for c in choice.splits if c.rejected is None)
    assert any(c.rejected == "one rank each" for c in choice.splits)


def test_one_device_has_no_split() -> None:
    shape, cluster, scenario, options = setup("model=meshcoder", "cluster=local-cpu")
    one = dataclasses.replace(cluster, devices_per_node=1, nvlink_domain_size=1)
    choice = choose_kind(shape, one, scenario, options)
    assert choice.kind == "colocated" and choice.splits == []
    assert "one device" in choice.explanation


def test_the_choice_is_checked_by_simulating_both_finalists() -> None:
    import re

    shape, cluster, scenario, options = setup(*LONG_PROMPTS_TIGHT_TPOT)
    choice = choose_kind(shape, cluster, scenario, options)
    found = re.search(r"Simulated at [\d.,]+ req/s over ([\d,]+) requests of these lengths "
                      r"\(([\d.]+) request lifetimes of arrivals\): colocated serves (\d+)% "
                      r"within both SLOs, the split (\d+)%", choice.explanation)
    assert found, choice.explanation
    num, span = int(found.group(1).replace(",", "")), float(found.group(2))
    colocated, split = int(found.group(3)), int(found.group(4))
    assert 200 <= num <= 2000 and (span >= 2.5 or num == 2000)
    assert 0 <= colocated <= 100 and 0 <= split <= 100
    assert split >= colocated  # the split wins here, and the simulation agrees


def test_plan_simulate_orders_the_shortlist_by_simulated_goodput() -> None:
    shape, cluster, scenario, options = setup(*LONG_PROMPTS_TIGHT_TPOT)
    sim_options = dataclasses.replace(options, simulate=True)
    choice = choose_kind(shape, cluster, scenario, sim_options)
    assert choice.simulated_goodput_req_s is not None
    colocated, split = choice.simulated_goodput_req_s
    shortlist = choice.splits[:SIM_SPLITS]
    goodputs = [simulated_goodput(shape, cluster, scenario, sim_options, c) for c in shortlist]
    assert goodputs[0] == split == max(goodputs)
    assert choice.kind == ("disaggregated" if split > 1.1 * colocated else "colocated")
    assert "Simulated goodput" in choice.explanation
    assert choose_kind(shape, cluster, scenario, options).simulated_goodput_req_s is None


def test_simulated_goodput_stays_below_the_saturated_throughput() -> None:
    """A long output's TPOT SLO leaves room for a long wait for a decode slot, so a finite
    run above the decode side's throughput still meets the SLOs; the search does not
    count such rates."""
    shape, cluster, scenario, options = setup("model=llama-3-70b", "cluster=dgx-h200",
                                              "scenario=codegen")
    split = next(c for c in splits(shape, cluster, scenario, options)
                 if c.rejected is None and c.decode.replicas == 1)
    budget = options.max_num_batched_tokens
    pre = Replicas(split.prefill.tp, split.prefill.pp, split.prefill.replicas, budget)
    dec = Replicas(split.decode.tp, split.decode.pp, split.decode.replicas, budget)
    capacity = capacity_disagg(shape, cluster, scenario, options, pre, dec)
    above = scenario_requests(scenario, 1.5 * capacity, 2000)
    burst = simulate_disagg(shape, cluster, scenario, options, pre, dec, above)
    assert burst is not None and burst.attained >= ATTAINMENT  # the finite run's verdict
    assert 0 < simulated_goodput(shape, cluster, scenario, options, split) < capacity
