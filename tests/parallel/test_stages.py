"""Stage layer ranges: exact splits, balanced by cost with the embedding and LM head counted."""

from __future__ import annotations

import pytest

from meshserve.parallel.stages import StageCosts, decoder_costs, stage_layer_ranges


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


def test_decoder_costs_of_a_llama_3_8b_shape() -> None:
    c = decoder_costs(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256)
    assert c.layer == 4096 * 128 * (64 + 16) + 3 * 4096 * 14336 + 2 * 4096
    assert c.head == 128256 * 4096 + 4096
    assert c.head / c.layer == pytest.approx(2.41, abs=0.01)
    # The embedding's tiny cost tips a 9-layer stage 0 past the bound of 9 layers.
    assert stage_layer_ranges(32, 4, c) == [(0, 8), (8, 17), (17, 26), (26, 32)]


def test_too_many_stages_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"parallel.pp=5 is invalid: allowed is at most "
                                         r"num_hidden_layers=4 \(every stage needs a layer\)"):
        stage_layer_ranges(4, 5)
