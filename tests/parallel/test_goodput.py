"""Goodput in closed form: the tails that decide attainment, against the step simulation."""

from __future__ import annotations

import dataclasses

import pytest

from meshserve.launch.cli_config import load_config
from meshserve.launch.plan import model_shape
from meshserve.parallel.planner.disagg_search import simulated_goodput, splits
from meshserve.parallel.planner.goodput import DecodeTail, attained_rate, colocated_goodput
from meshserve.parallel.planner.prediction import cached_tokens
from meshserve.parallel.planner.search import evaluate, options_for, sized


def setup(*overrides: str):  # noqa: ANN201
    cfg = load_config(list(overrides))
    scenario = dataclasses.replace(cfg.scenario, objective="throughput")
    return model_shape(cfg, cfg.cluster), cfg.cluster, scenario, options_for(cfg)


CPU_RAG = ("model=meshcoder", "model.dtype=float32", "cluster=local-cpu", "scenario=rag")  # prompts stall decodes
H100_CHAT = ("model=llama-3-8b", "cluster=dgx-h100", "scenario=chatbot")  # the batch cap binds


@pytest.mark.parametrize(("overrides", "kind"), [(CPU_RAG, "colocated"),
                                                 (H100_CHAT, "colocated"),
                                                 (CPU_RAG, "split")])
def test_goodput_tracks_the_step_simulation(overrides: tuple[str, ...], kind: str) -> None:
    shape, cluster, scenario, options = setup(*overrides)
    layout = (evaluate(shape, cluster, scenario, (1, 1, 1), options) if kind == "colocated"
              else next(c for c in splits(shape, cluster, scenario, options)
                        if c.rejected is None))
    assert layout.prediction is not None
    simulated = simulated_goodput(shape, cluster, scenario, options, layout)
    assert 0.8 * simulated <= layout.prediction.goodput_req_s <= 1.2 * simulated  # 20%


def test_a_tighter_slo_never_serves_more() -> None:
    shape, cluster, scenario, options = setup(*CPU_RAG)
    cand, cost = sized(shape, cluster, scenario, 1, 1, options)
    assert cost is not None
    largest = min(scenario.max_batch, cand.kv_capacity_tokens
                  // (scenario.prompt_len + scenario.output_len))
    cached = cached_tokens(scenario)

    def goodput(**slo: float) -> float:
        return colocated_goodput(cost, dataclasses.replace(scenario, **slo), dp=1,
                                 largest=largest, cached=cached)

    tpots = [goodput(tpot_slo_ms=ms) for ms in (40, 20, 12, 8)]
    assert tpots == sorted(tpots, reverse=True) and tpots[0] > tpots[-1] > 0
    ttfts = [goodput(ttft_slo_ms=ms) for ms in (8000, 4000, 2000, 1000)]
    assert ttfts == sorted(ttfts, reverse=True) and ttfts[0] > ttfts[-1] > 0


def test_prompts_stall_colocated_decodes_and_not_a_split_s() -> None:
    shape, cluster, scenario, options = setup(*CPU_RAG)
    _, cost = sized(shape, cluster, scenario, 1, 1, options)
    assert cost is not None
    prefill = cost.prefill_busy_s(scenario.prompt_len, cached_tokens(scenario))
    split = DecodeTail(cost, scenario, 64)
    colocated = DecodeTail(cost, scenario, 64, prompts=True, cached=cached_tokens(scenario))
    rate = 0.5 / prefill  # prompts keep the replica busy half the time
    assert colocated.share(rate) < split.share(rate)
    assert colocated.others(rate) > split.others(rate)  # the stalls stretch every life
    assert colocated.share(1.0 / prefill) == 0.0  # prompts alone fill the replica


@pytest.mark.parametrize("pp", [1, 2])
def test_a_prompt_always_stalls_for_some_time(pp: int) -> None:
    """A pipeline round's micro-batches change with the sequences in it, so a round with a
    prompt can be priced under one without: the stall is the prompt's slowest stage."""
    shape, cluster, scenario, options = setup(*H100_CHAT)
    cand, cost = sized(shape, cluster, scenario, 1, pp, options)
    assert cost is not None
    tail = DecodeTail(cost, scenario, 64, prompts=True)
    assert all(tail.stall_s(b) > 0 for b in (1, 2, 16))
    largest = min(64, cand.kv_capacity_tokens // (scenario.prompt_len + scenario.output_len))
    assert colocated_goodput(cost, scenario, dp=1, largest=largest) > 0


def test_attained_rate_bisects_a_falling_share() -> None:
    assert attained_rate(lambda r: 1 - r / 10, upper=10.0) == pytest.approx(1.0, rel=1e-3)
    assert attained_rate(lambda r: 0.5, upper=10.0) == 0.0
