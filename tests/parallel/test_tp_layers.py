"""Sharded layers: each rank's slice of the checkpoint reassembles the unsharded layer.

Runs each TP rank's shard in one process (no communication): column-parallel outputs
concatenate, row-parallel partial sums add up, to the unsharded result.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from meshserve.parallel.comm.tp_group import TensorParallelGroup
from meshserve.parallel.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from meshserve.parallel.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from meshserve.parallel.layers.weights import InMemoryTensor, WeightShapeError


def tp(rank: int, size: int) -> TensorParallelGroup:
    return TensorParallelGroup(rank, size, None if size == 1 else mock.sentinel.group)


def load(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shard: object = None) -> None:
    param = getattr(layer, name)
    param.weight_loader(param, InMemoryTensor(name, tensor), shard)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_column_and_row_parallel_reassemble(size: int) -> None:
    g = torch.Generator().manual_seed(0)
    w1, b1 = torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
    w2, b2 = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    x = torch.randn(3, 8, generator=g)
    hidden, partial = [], []
    for r in range(size):
        col = ColumnParallelLinear(8, 16, bias=True, tp=tp(r, size))
        load(col, "weight", w1)
        load(col, "bias", b1)
        h = col(x)
        hidden.append(h)
        row = RowParallelLinear(16, 8, bias=False, tp=tp(r, size))
        load(row, "weight", w2)
        partial.append(F.linear(h, row.weight))
    full_hidden = torch.cat(hidden, dim=-1)
    torch.testing.assert_close(full_hidden, F.linear(x, w1, b1))
    torch.testing.assert_close(sum(partial) + b2, F.linear(full_hidden, w2, b2))


@pytest.mark.parametrize(("size", "num_kv_heads"), [(1, 2), (2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_sharding_with_kv_replication(size: int, num_kv_heads: int) -> None:
    heads, d, hidden = 4, 3, 12
    g = torch.Generator().manual_seed(1)
    wq = torch.randn(heads * d, hidden, generator=g)
    wk = torch.randn(num_kv_heads * d, hidden, generator=g)
    wv = torch.randn(num_kv_heads * d, hidden, generator=g)
    for r in range(size):
        layer = QKVParallelLinear(hidden, d, heads, num_kv_heads, tp=tp(r, size))
        for shard, w in (("q", wq), ("k", wk), ("v", wv)):
            load(layer, "weight", w, shard)
        q_heads = heads // size
        kv = layer.num_local_kv_heads
        assert kv == max(1, num_kv_heads // size)
        kv_start = r * kv if size <= num_kv_heads else r // (size // num_kv_heads)
        expect = torch.cat([wq[r * q_heads * d:(r + 1) * q_heads * d],
                            wk[kv_start * d:(kv_start + kv) * d],
                            wv[kv_start * d:(kv_start + kv) * d]])
        torch.testing.assert_close(layer.weight, expect)
        # the query heads of this rank map onto the KV head it holds (GQA groups stay whole)
        group = heads // num_kv_heads
        assert (r * q_heads) // group >= kv_start
        assert ((r + 1) * q_heads - 1) // group < kv_start + kv


def test_merged_gate_up_shards() -> None:
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)
    for r in range(2):
        layer = MergedColumnParallelLinear(4, [8, 8], tp=tp(r, 2))
        load(layer, "weight", gate, 0)
        load(layer, "weight", up, 1)
        torch.testing.assert_close(layer.weight, torch.cat([gate[r * 4:(r + 1) * 4],
                                                            up[r * 4:(r + 1) * 4]]))


def test_vocab_parallel_embedding_and_head_with_uneven_vocab() -> None:
    g = torch.Generator().manual_seed(3)
    table = torch.randn(10, 4, generator=g)
    ids = torch.tensor([0, 3, 4, 9, 7])
    sums = torch.zeros(5, 4)
    logits = []
    for r in range(4):  # 10 rows over 4 ranks: 3, 3, 3, 1 (padded)
        emb = VocabParallelEmbedding(10, 4, tp=tp(r, 4))
        load(emb, "weight", table)
        in_range = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        local = torch.where(in_range, ids - emb.vocab_start, 0)
        sums += F.embedding(local, emb.weight) * in_range.unsqueeze(-1)
        head = ParallelLMHead(10, 4, tp=tp(r, 4))
        load(head, "weight", table)
        logits.append(F.linear(sums[:1], head.weight))
    torch.testing.assert_close(sums, table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :10], F.linear(sums[:1], table))


def test_indivisible_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by the "
                                         "tensor-parallel size 4"):
        QKVParallelLinear(24, 4, 6, 2, tp=tp(0, 4))
    with pytest.raises(ValueError, match="must divide or be a multiple of num_key_value_heads=3"):
        QKVParallelLinear(48, 4, 12, 3, tp=tp(0, 4))


def test_wrong_checkpoint_shape_names_the_tensor() -> None:
    layer = ColumnParallelLinear(8, 16, tp=tp(0, 2))
    with pytest.raises(WeightShapeError, match=r"tensor 'weight' has shape \[16, 7\], "
                                               r"expected \[16, 8\]"):
        load(layer, "weight", torch.zeros(16, 7))
