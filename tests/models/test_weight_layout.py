"""CPU weight layout: wide linear weights stored column-major, same logits."""

from __future__ import annotations

import pytest
import torch

from meshserve.engine.host_memory import HUGE_PAGE_BYTES
from meshserve.engine.model_runner import ModelRunner
from meshserve.models.loader import column_major_wide_weights, load_model


class _Seq:
    def __init__(self, token_ids: list[int]) -> None:
        self.seq_id, self.token_ids, self.start_pos = 0, token_ids, 0
        self.block_table, self.sample = [0, 1], True


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    attn = model.attention_layers()[0]
    shape = (2, 16, attn.num_kv_heads, attn.head_dim)
    cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.attention_layers()]
    return ModelRunner(model, cache, 16, torch.device("cpu")).execute([_Seq(ids)])[0]


def test_wide_weights_go_column_major_and_logits_stay(make_checkpoint) -> None:
    path = make_checkpoint("llama", seed=7, tie_word_embeddings=False)
    model = load_model(path, progress=False)  # CPU: converted on load
    layer = model.model.layers["0"]
    gate_up = layer.mlp.gate_up_proj.weight
    assert gate_up.stride() == (1, gate_up.shape[0])
    assert model.lm_head.weight.stride()[0] == 1  # untied LM head: wide, converted
    assert layer.self_attn.o_proj.weight.is_contiguous()  # square: kept
    assert layer.mlp.down_proj.weight.is_contiguous()  # narrow: kept
    assert model.model.embed_tokens.weight.is_contiguous()  # the embedding gathers rows
    row_major = load_model(path, progress=False)
    for p in row_major.parameters():
        p.data = p.data.contiguous()
    assert row_major.model.layers["0"].mlp.gate_up_proj.weight.is_contiguous()
    ids = [3, 14, 15, 92, 65]
    torch.testing.assert_close(_logits(model, ids), _logits(row_major, ids), atol=1e-5,
                               rtol=1e-5)
    # qkv and gate_up of every layer, and the LM head
    assert column_major_wide_weights(row_major) == 2 * len(row_major.model.layers) + 1


def test_a_tied_lm_head_stays_row_major(make_checkpoint) -> None:
    model = load_model(make_checkpoint("llama", seed=7, tie_word_embeddings=True),
                       progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.is_contiguous()


@pytest.mark.parametrize("tied", [True, False])
def test_huge_page_weights_give_the_same_logits(make_checkpoint, tied: bool) -> None:
    # 8448 x 64 fp32 = 2.1 MB: the embedding (and an untied, column-major head) move.
    path = make_checkpoint("llama", seed=7, tie_word_embeddings=tied, vocab_size=8448)
    moved = load_model(path, progress=False)
    plain = load_model(path, progress=False, huge_pages=False)
    embed, head = moved.model.embed_tokens.weight, moved.lm_head.weight
    assert embed.data_ptr() % HUGE_PAGE_BYTES == 0 and head.data_ptr() % HUGE_PAGE_BYTES == 0
    assert (head is embed) == tied
    assert head.stride() == plain.lm_head.weight.stride()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert torch.equal(_logits(moved, ids), _logits(plain, ids))
