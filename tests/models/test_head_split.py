"""A pipeline's LM head split between its first and last stage: each stage loads only its
vocabulary rows, and the two parts side by side are the whole head's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshserve.kernels.dispatch import out_features
from meshserve.models.loader import load_model


@pytest.mark.parametrize("tied", [False, True])
def test_the_two_parts_of_a_split_head_are_the_whole_head(make_checkpoint, tied: bool) -> None:
    path: Path = make_checkpoint("llama", num_hidden_layers=3, tie_word_embeddings=tied)
    whole = load_model(path, progress=False)
    first = load_model(path, layer_range=(0, 2), head_split=100, progress=False)
    last = load_model(path, layer_range=(2, 3), head_split=100, progress=False)
    vocab = whole.arch.vocab_size
    assert first.lm_head is not None and last.lm_head is not None
    assert (out_features(first.lm_head.weight), out_features(last.lm_head.weight)) == (
        100, vocab - 100)
    hidden = torch.randn(5, whole.arch.hidden_size)
    parts = [first.compute_logits(hidden), last.compute_logits(hidden)]
    assert [p.shape[-1] for p in parts if p is not None] == [100, vocab - 100]
    torch.testing.assert_close(torch.cat(parts, dim=-1), whole.compute_logits(hidden))
    middle = load_model(make_checkpoint("llama", num_hidden_layers=3), layer_range=(1, 2),
                        head_split=100, progress=False)
    assert middle.lm_head is None  # a middle stage holds no part of the head
