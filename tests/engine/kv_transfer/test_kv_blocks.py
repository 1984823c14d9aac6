"""KV blocks in and out of a paged cache, and the KV heads each TP rank holds."""

from __future__ import annotations

import pytest
import torch

from meshserve.engine.kv_transfer.blocks import (
    gather_blocks,
    kv_head_range,
    scatter_blocks,
)

LAYERS, BLOCKS, BS, DIM = 3, 10, 4, 8


def _cache(heads: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BLOCKS, BS, heads, DIM, generator=g),
             torch.randn(BLOCKS, BS, heads, DIM, generator=g)) for _ in range(LAYERS)]


def test_gather_then_scatter_moves_exactly_the_blocks_asked_for() -> None:
    src, dst = _cache(2, 0), _cache(2, 1)
    before = [(k.clone(), v.clone()) for k, v in dst]
    packed = gather_blocks(src, [5, 1, 7])
    assert packed.shape == (LAYERS, 2, 3, BS, 2, DIM)
    scatter_blocks(dst, [0, 2, 9], packed)
    for layer in range(LAYERS):
        for which in (0, 1):
            for s, d in zip([5, 1, 7], [0, 2, 9], strict=True):
                assert torch.equal(dst[layer][which][d], src[layer][which][s])
            for untouched in (1, 3, 4, 5, 6, 7, 8):
                assert torch.equal(dst[layer][which][untouched], before[layer][which][untouched])
    with pytest.raises(ValueError, match=r"do not fit this cache: it takes \(3, 2, 2, 4, 2, 8\)"):
        scatter_blocks(dst, [0, 2], packed)


def test_head_ranges_follow_the_qkv_sharding() -> None:
    assert [kv_head_range(r, 2, 4) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [kv_head_range(r, 4, 2) for r in range(4)] == [range(0, 1), range(0, 1),
                                                         range(1, 2), range(1, 2)]
    with pytest.raises(ValueError, match="must divide or be a multiple"):
        kv_head_range(0, 3, 2)
