"""CUDA-graph planning and static-buffer padding (pure logic and CPU tensors; capture on GPU)."""

from __future__ import annotations

import pytest
import torch

from meshserve.engine.worker import cuda_graphs as cg
from meshserve.models.attention import AttentionMetadata


def test_graph_batch_sizes() -> None:
    assert cg.graph_batch_sizes(1) == [1]
    assert cg.graph_batch_sizes(3) == [1, 2, 3]
    assert cg.graph_batch_sizes(8) == [1, 2, 4, 8]
    assert cg.graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert cg.graph_batch_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert cg.graph_batch_sizes(1000)[-1] == 256
    with pytest.raises(ValueError, match="max_num_seqs"):
        cg.graph_batch_sizes(0)


def test_bucket_for() -> None:
    sizes = [1, 2, 4, 8, 16, 20]
    assert [cg.bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 20)] == \
        [1, 2, 4, 8, 8, 16, 20, 20]
    assert cg.bucket_for(21, sizes) is None


def _decode_meta(n: int, width: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    ids = torch.arange(10, 10 + n)
    pos = torch.arange(30, 30 + n)
    tables = torch.arange(1, 1 + n * width).view(n, width)
    meta = AttentionMetadata(slot_mapping=torch.arange(100, 100 + n), num_decode_tokens=n,
                             decode_block_tables=tables,
                             decode_context_lens=torch.arange(31, 31 + n), prefills=[])
    return ids, pos, meta


def test_fill_pads_rows_past_the_batch() -> None:
    bufs = cg.DecodeBuffers.allocate(8, 4, torch.device("cpu"))
    assert bufs.slot_mapping.tolist() == [-1] * 8
    bufs.fill(*_decode_meta(5, 4), bucket=8)  # a full-width step leaves stale rows behind
    bufs.fill(*_decode_meta(3, 2), bucket=4)
    assert bufs.input_ids[:4].tolist() == [10, 11, 12, 0]
    assert bufs.positions[:4].tolist() == [30, 31, 32, 0]
    assert bufs.slot_mapping[:4].tolist() == [100, 101, 102, -1]
    assert bufs.context_lens[:4].tolist() == [31, 32, 33, 0]
    assert bufs.block_tables[:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    meta = bufs.meta(4)
    assert meta.num_decode_tokens == 4 and meta.decode_block_tables.shape == (4, 4)
    assert meta.slot_mapping.data_ptr() == bufs.slot_mapping.data_ptr()  # views, not copies


def test_fill_rejects_what_does_not_fit() -> None:
    bufs = cg.DecodeBuffers.allocate(4, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="bucket"):
        bufs.fill(*_decode_meta(3, 2), bucket=2)
    with pytest.raises(ValueError, match="captured width"):
        bufs.fill(*_decode_meta(2, 3), bucket=2)


def test_graphs_need_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        cg.DecodeGraphs(lambda i, p, m: i, [1], 4, torch.device("cpu"))
