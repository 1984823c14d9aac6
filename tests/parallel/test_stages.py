"""Stage layer ranges: exact splits, balanced by cost with the embedding and LM head counted."""

from __future__ import annotations

import dataclasses

import pytest

from meshserve.launch.cli_config import load_config
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.search import plan_for, runtime_stage_ranges, stage_ranges
from meshserve.parallel.planner.stages import StageCosts, stage_layer_ranges


@pytest.mark.parametrize(("num_layers", "num_stages", "expected"), [
    (4, 1, [(0, 4)]),
    (4, 2, [(0, 2), (2, 4)]),
    (3, 2, [(0, 2), (2, 3)]),                   # uneven: earlier stages take the extra layer
    (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (3, 3, [(0, 1), (1, 2), (2, 3)]),
    (32, 4, [(0, 8), (8, 16), (16, 24), (24, 32)]),
])
def test_equal_layers_without_extras(num_layers: int, num_stages: int,
                                     expected: list[tuple[int, int]]) -> None:
    assert stage_layer_ranges(num_layers, num_stages) == expected


def test_heavy_lm_head_takes_layers_off_the_last_stage() -> None:
    # Llama-3-8B-like: the head costs ~2.4 layers; an even 8/8/8/8 split would leave the
    # last stage at 10.4, this one at most 9.
    costs = StageCosts(layer=1.0, embed=0.0, head=2.4)
    assert stage_layer_ranges(32, 4, costs) == [(0, 9), (9, 18), (18, 27), (27, 32)]
    assert stage_layer_ranges(4, 2, StageCosts(layer=1.0, head=2.0)) == [(0, 3), (3, 4)]


def test_heavy_embedding_takes_layers_off_the_first_stage() -> None:
    costs = StageCosts(layer=1.0, embed=2.0)
    assert stage_layer_ranges(6, 2, costs) == [(0, 2), (2, 6)]


def test_more_splits_balanced_by_cost() -> None:
    assert stage_layer_ranges(80, 2, StageCosts(layer=1.0, head=1.2)) == [(0, 41), (41, 80)]
    assert stage_layer_ranges(10, 3, StageCosts(layer=1.0, embed=2.0)) == [(0, 2), (2, 6),
                                                                           (6, 10)]
    assert stage_layer_ranges(3, 3, StageCosts(layer=1.0, head=100.0)) == [(0, 1), (1, 2),
                                                                            (2, 3)]


def test_the_runtime_splits_as_the_planner_predicts() -> None:
    cfg = load_config(["model=llama-3-8b", "cluster=dgx-h100", "parallel.tp=2",
                       "parallel.pp=4"])
    arch = ModelArch.from_hf_dict(cfg.model.arch)
    planned = plan_for(cfg, arch).stage_layers
    # At the chatbot batch the head costs ~2.4 layers and the embedding tips stage 0 past 9.
    assert planned == ((0, 8), (8, 17), (17, 26), (26, 32))
    assert runtime_stage_ranges(cfg, arch, 2, 4) == list(planned)


def test_the_runtime_split_on_a_preset_with_fewer_devices() -> None:
    cfg = load_config(["cluster=local-cpu"])  # 2 CPU ranks; tp=4 still gets ranges
    arch = ModelArch.from_hf_dict(load_config(["model=llama-3-8b"]).model.arch)
    assert runtime_stage_ranges(cfg, arch, 4, 2) == stage_ranges(
        ModelShape.from_arch(arch, "float32"),
        dataclasses.replace(cfg.cluster, num_nodes=2), cfg.scenario, 4, 2)


def test_too_many_stages_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"parallel.pp=5 is invalid: allowed is at most "
                                         r"num_hidden_layers=4 \(every stage needs a layer\)"):
        stage_layer_ranges(4, 5)
