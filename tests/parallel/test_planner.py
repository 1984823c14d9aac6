"""Planner: rules, ranking per scenario, placement and stage layer ranges."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from meshserve.launch.cli_config import load_config
from meshserve.models.arch import ModelArch
from meshserve.parallel.parallel_config import ParallelConfig
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.placement import place_ranks
from meshserve.parallel.planner.scenario import ScenarioConfig
from meshserve.parallel.planner.search import (
    Candidate,
    PlannerOptions,
    enumerate_degrees,
    plan,
    plan_for,
    stage_ranges,
)


def setup(model: str, cluster: str, scenario: str) -> tuple[ModelShape, ClusterConfig,
                                                            ScenarioConfig]:
    cfg = load_config([f"model={model}", f"cluster={cluster}", f"scenario={scenario}"])
    arch = ModelArch.from_hf_dict(cfg.model.arch)
    return ModelShape.from_arch(arch, "bfloat16"), cfg.cluster, cfg.scenario


def find(cands: tuple[Candidate, ...], tp: int, pp: int, dp: int) -> tuple[int, Candidate]:
    return next((i, c) for i, c in enumerate(cands) if (c.tp, c.pp, c.dp) == (tp, pp, dp))


def test_70b_bf16_does_not_fit_one_80_gb_gpu() -> None:
    shape, h100, chat = setup("llama-3-70b", "dgx-h100", "chatbot")
    with pytest.raises(ValueError, match=r"tp=1 pp=1 dp=1: weights 141.1 GB \+ activations "
                                         r"0.386 GB per device > 72.0 GB usable \(80 GB x 0.9\)"):
        plan(shape, h100, chat, degrees=(1, 1, 1))


def test_one_dgx_h100_keeps_tp_inside_the_node() -> None:
    shape, h100, chat = setup("llama-3-70b", "dgx-h100", "chatbot")
    p = plan(shape, h100, chat)
    assert (p.tp, p.pp, p.dp) == (8, 1, 1)
    assert p.warnings == ()
    assert {pl.node for pl in p.placements} == {0}
    assert [pl.local_device for pl in p.placements] == list(range(8))
    _, tp1 = find(p.candidates, 1, 1, 8)
    assert tp1.rejected is not None and tp1.rejected.startswith("weights 141.1 GB")


def test_two_dgx_h100_prefer_tp8_pp2_over_tp16() -> None:
    shape, h100x2, chat = setup("llama-3-70b", "dgx-h100-2node", "chatbot")
    p = plan(shape, h100x2, chat)
    assert (p.tp, p.pp, p.dp) == (8, 1, 2)  # one TP=8 replica per node
    i_pp2, pp2 = find(p.candidates, 8, 2, 1)
    i_tp16, tp16 = find(p.candidates, 16, 1, 1)
    assert i_pp2 == 1 and i_pp2 < i_tp16
    assert tp16.rejected == ("TP=16 spans NVLink domains of 8 (runs over the slower link); "
                             "a layout inside the domains fits")
    assert pp2.stage_layers == ((0, 40), (40, 80))
    # Even when TP may cross nodes, the cost model ranks it below TP=8 x PP=2.
    free = plan(shape, h100x2, chat, PlannerOptions(allow_cross_domain_tp=True))
    i_pp2, pp2 = find(free.candidates, 8, 2, 1)
    i_tp16, tp16 = find(free.candidates, 16, 1, 1)
    assert i_pp2 < i_tp16 and tp16.rejected is None and tp16.warning is not None
    assert tp16.prediction.tpot_ms > 3 * pp2.prediction.tpot_ms
    assert tp16.prediction.ttft_ms > 3 * pp2.prediction.ttft_ms


def test_pipeline_stages_cross_nodes_tp_groups_do_not() -> None:
    shape, h100x2, chat = setup("llama-3-70b", "dgx-h100-2node", "chatbot")
    p = plan(shape, h100x2, chat, degrees=(8, 2, 1))
    assert [(pl.node, pl.pp_rank) for pl in p.placements] == [(0, 0)] * 8 + [(1, 1)] * 8
    assert p.num_micro_batches == 2
    assert p.rank_of(dp_rank=0, pp_rank=1, tp_rank=3) == 11
    mixed = place_ranks(4, 2, 2, h100x2)
    assert [(pl.rank, pl.node, pl.local_device, pl.dp_rank, pl.pp_rank, pl.tp_rank)
            for pl in mixed[6:10]] == [(6, 0, 6, 0, 1, 2), (7, 0, 7, 0, 1, 3),
                                       (8, 1, 0, 1, 0, 0), (9, 1, 1, 1, 0, 1)]


def test_pcie_l40s_avoids_wide_tp() -> None:
    shape, l40s, offline = setup("llama-3-8b", "l40s-pcie", "offline")
    p = plan(shape, l40s, offline)
    assert (p.tp, p.pp, p.dp) == (1, 1, 8)
    assert all(c.rejected for c in p.candidates if c.tp > 1)
    # Allowed to run TP over PCIe, the model still ranks every wider TP lower, TP=8 last.
    free = plan(shape, l40s, offline, PlannerOptions(allow_cross_domain_tp=True))
    assert free.tp == 1
    accepted = [c for c in free.candidates if c.rejected is None]
    assert accepted[-1].tp == 8
    assert [c.tp for c in accepted[:3]] == [1, 1, 1]


def test_70b_on_pcie_l40s_pipelines_rather_than_tensor_splits() -> None:
    shape, l40s, chat = setup("llama-3-70b", "l40s-pcie", "chatbot")
    p = plan(shape, l40s, chat)
    assert p.tp == 1 and p.pp * p.dp == 8 and p.pp >= 4  # 141 GB over 48 GB cards


def test_tp_across_domains_only_when_forced_with_a_warning() -> None:
    # One layer (no pipelining possible) too big for two 15 MB devices: TP must span 4.
    shape = ModelShape(num_layers=1, hidden_size=1024, intermediate_size=4096, num_heads=8,
                       num_kv_heads=4, head_dim=128, vocab_size=1000)
    toy = ClusterConfig(name="toy", device_type="cpu", devices_per_node=4, nvlink_domain_size=2,
                        device_memory_gb=0.015)
    chat = ScenarioConfig(name="toy", prompt_len=8, output_len=8, max_batch=1)
    p = plan(shape, toy, chat, PlannerOptions(max_num_batched_tokens=16))
    assert (p.tp, p.pp, p.dp) == (4, 1, 1)
    assert p.warnings == ("TP=4 spans NVLink domains of 2 (runs over the slower link): forced, "
                          "no layout inside the NVLink domains fits",)
    _, half = find(p.candidates, 2, 1, 2)
    assert half.rejected == ("weights 0.0178 GB + activations 0.000264 GB per device > "
                             "0.0135 GB usable (0.015 GB x 0.9)")


def test_plan_stage_ranges_follow_the_lm_head_at_small_batch() -> None:
    shape, h100, chat = setup("llama-3-8b", "dgx-h100", "chatbot")
    p = plan(shape, h100, chat, PlannerOptions(split_lm_head=False), degrees=(1, 4, 1))
    # At batch 32 and 640 tokens of context the 8B LM head costs ~2.0 layers: its stage
    # runs 6; the embedding's sliver of cost leaves stage 0 one layer short of the others.
    assert p.stage_layers == ((0, 8), (8, 17), (17, 26), (26, 32))
    # On GPUs the head is not split (default options included); at TP 2 nowhere.
    assert plan(shape, h100, chat, degrees=(1, 4, 1)).stage_layers == p.stage_layers
    assert stage_ranges(shape, h100, chat, 2, 4, True, "cpu") == [
        (0, 8), (8, 17), (17, 26), (26, 32)]
    # Split between first and last stage (CPU pipelines at TP 1), ~1.0 layer each: even.
    assert stage_ranges(shape, h100, chat, 1, 4, True, "cpu") == [
        (0, 8), (8, 16), (16, 24), (24, 32)]


def test_stage_ranges_weigh_prefill_and_decode_as_the_scenario_does() -> None:
    shape, h100, _ = setup("llama-3-8b", "dgx-h100", "chatbot")
    # Long prompts, few output tokens: prefill dominates and the head runs for one row per
    # prompt, so the split is even. Short prompts, long outputs: the head runs at every
    # decode step and its stage gets fewer layers.
    prefill_heavy = ScenarioConfig(name="p", prompt_len=4096, output_len=16, max_batch=32)
    decode_heavy = ScenarioConfig(name="d", prompt_len=16, output_len=4096, max_batch=32)
    assert stage_ranges(shape, h100, prefill_heavy, 1, 2) == [(0, 16), (16, 32)]
    (_, split), _ = stage_ranges(shape, h100, decode_heavy, 1, 2)
    assert split > 16


def test_enumeration_uses_every_device() -> None:
    assert enumerate_degrees(4) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1),
                                    (4, 1, 1)]


def test_scenarios_rank_by_their_first_metric() -> None:
    shape, h100, _ = setup("llama-3-8b", "dgx-h100", "chatbot")
    chosen = {}
    for name in ("chatbot", "codegen", "offline", "rag"):
        sc = load_config([f"scenario={name}"]).scenario
        p = plan(shape, h100, sc)
        chosen[name] = (p.tp, p.pp, p.dp)
        best = p.candidates[0].prediction
        assert best is not None and best.meets_slo
    assert chosen["chatbot"][0] > chosen["offline"][0]  # latency buys TP; utilization doesn't
    assert chosen["offline"] == (1, 1, 8)


def test_plan_for_takes_configured_degrees_or_plans_under_auto() -> None:
    cfg = load_config(["model=llama-3-8b", "cluster=dgx-h100", "parallel.tp=2"])
    arch = ModelArch.from_hf_dict(cfg.model.arch)
    fixed = plan_for(cfg, arch)
    assert (fixed.tp, fixed.pp, fixed.dp, len(fixed.placements)) == (2, 1, 1, 2)
    auto = dataclasses.replace(cfg, parallel=SimpleNamespace(auto=True, num_micro_batches=None,
                                                                split_lm_head=True))
    chosen = plan_for(auto, arch)
    assert (chosen.tp, chosen.pp, chosen.dp) == (4, 1, 2)  # 8B chatbot: TP=8 pays more in latency
    with pytest.raises(ValueError, match=r"parallel.tp\*pp\*dp=\(16, 1, 1\) is invalid"):
        plan_for(load_config(["model=llama-3-8b", "cluster=dgx-h100", "parallel.tp=16"]), arch)


def test_planner_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"plan.memory_utilization=1.5 is invalid"):
        PlannerOptions(memory_utilization=1.5)


@pytest.mark.skipif("auto" not in {f.name for f in dataclasses.fields(ParallelConfig)},
                    reason="parallel=auto needs ParallelConfig.auto (see conf/parallel/auto.yaml)")
def test_parallel_auto_preset_plans() -> None:
    cfg = load_config(["parallel=auto", "model=llama-3-8b", "cluster=dgx-h100"])
    chosen = plan_for(cfg, ModelArch.from_hf_dict(cfg.model.arch))
    assert (chosen.tp, chosen.pp, chosen.dp) == (4, 1, 2)
