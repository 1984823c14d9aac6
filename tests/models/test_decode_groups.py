"""The CPU decode attention groups rows of similar context length; the result must be
exactly what one padded call gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.kernels.paged_attention import (
    _paged_decode_padded,
    length_groups,
    paged_decode,
)


def test_groups_bound_the_spread_and_cover_every_row() -> None:
    groups = length_groups([40, 770, 100, 33, 400, 16], block_size=16)
    assert groups == [([5], 1), ([0, 3], 3), ([2], 7), ([4, 1], 49)]


@given(st.lists(st.integers(1, 600), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_groups_partition_the_rows(lens: list[int]) -> None:
    groups = length_groups(lens, block_size=16)
    assert sorted(r for rows, _ in groups for r in rows) == list(range(len(lens)))
    for rows, n_blocks in groups:
        blocks = [-(-lens[r] // 16) for r in rows]
        assert n_blocks == max(blocks) and max(blocks) <= 2 * min(blocks)


@pytest.mark.parametrize("window", [None, 37])
def test_grouped_decode_equals_one_padded_call(window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    num_blocks, bs, hkv, d, h = 64, 16, 2, 32, 8
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    lens = torch.tensor([5, 300, 17, 160, 33, 90, 1])
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:20] for _ in lens])
    q = torch.randn(len(lens), h, d, generator=g)
    got = paged_decode(q, k_cache, v_cache, tables, lens, 0.2, window)
    want = _paged_decode_padded(q, k_cache, v_cache, tables, lens, 0.2, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
