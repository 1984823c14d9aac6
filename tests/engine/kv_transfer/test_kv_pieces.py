"""KV pieces between replicas of different TP and PP layouts: every layer and head of a
destination rank comes from exactly one source rank, and packing then unpacking the
pieces rebuilds the destination's share of the model's KV."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.engine.kv_transfer.pieces import (
    RankKV,
    pack,
    pieces_for,
    pieces_from,
    restrict,
    unpack,
)

L, H, BLOCKS, BS, D = 6, 4, 5, 2, 3


def layout(tp: int, cuts: list[int], first_rank: int = 0) -> list[RankKV]:
    """Ranks of a replica: stages between `cuts`, tp ranks per stage (tp inner)."""
    bounds = [0, *cuts, L]
    return [RankKV.of(first_rank + s * tp + t, (bounds[s], bounds[s + 1]), t, tp, H)
            for s in range(len(bounds) - 1) for t in range(tp)]


def cache_of(full: torch.Tensor, r: RankKV) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A rank's cache cut from the model's whole KV [L, 2, blocks, bs, H, D]."""
    h = slice(*r.heads)
    return [(full[i, 0][:, :, h].clone(), full[i, 1][:, :, h].clone())
            for i in range(*r.layers)]


layouts = st.tuples(st.sampled_from([1, 2, 4, 8]),
                    st.lists(st.integers(1, L - 1), max_size=2, unique=True).map(sorted))


@settings(max_examples=60, deadline=None)
@given(src=layouts, dst=layouts, blocks=st.lists(st.integers(0, BLOCKS - 1), min_size=1,
                                                 max_size=BLOCKS, unique=True))
def test_pieces_rebuild_every_destination_rank(src: tuple[int, list[int]],
                                               dst: tuple[int, list[int]],
                                               blocks: list[int]) -> None:
    sources = layout(*src)
    dests = layout(*dst, first_rank=100)
    full = torch.randn(L, 2, BLOCKS, BS, H, D)
    caches = {r.rank: cache_of(full, r) for r in sources + dests}
    for d in dests:
        for k, v in caches[d.rank]:
            k.zero_()
            v.zero_()
    into = list(reversed(blocks))  # the destination's own block ids differ
    sent = [p for s in sources for p in pieces_from(s, sources, dests)]
    for p in sent:
        unpack(caches[p.dst.rank], p.dst, p, into, pack(caches[p.src.rank], p.src, p, blocks))
    for d in dests:
        want = cache_of(full[:, :, blocks], d)
        got = [(k[into], v[into]) for k, v in caches[d.rank]]
        for (wk, wv), (gk, gv) in zip(want, got, strict=True):
            assert torch.equal(wk, gk) and torch.equal(wv, gv)
        mine = pieces_for(sources, d)
        cells = [(layer, h) for p in mine for layer in range(*p.layers)
                 for h in range(*p.heads)]
        assert len(cells) == len(set(cells)) == (d.layers[1] - d.layers[0]) * \
            (d.heads[1] - d.heads[0])  # each once, nothing more
    pairs = [(p.src.rank, p.dst.rank) for p in sent]
    assert len(pairs) == len(set(pairs))  # one piece per source-destination pair


def test_tp2_to_tp1_takes_half_the_heads_from_each_source() -> None:
    pieces = pieces_for(layout(2, []), layout(1, [])[0])
    assert [(p.src.rank, p.heads) for p in pieces] == [(0, (0, 2)), (1, (2, 4))]


def test_replicated_heads_come_from_the_first_holder() -> None:
    src = layout(8, [])  # 8 ranks, 4 heads: each head on two ranks
    assert [p.src.rank for p in pieces_for(src, layout(1, [])[0])] == [0, 2, 4, 6]


def test_sources_that_miss_a_layer_are_refused() -> None:
    with pytest.raises(ValueError, match="no source rank holds layer 3"):
        pieces_for([RankKV(0, (0, 3), (0, H))], RankKV(1, (0, L), (0, H)))


@settings(max_examples=30, deadline=None)
@given(src=layouts, dst=layouts, cut=st.integers(0, L))
def test_pieces_restricted_to_two_layer_ranges_move_what_the_whole_ones_do(
        src: tuple[int, list[int]], dst: tuple[int, list[int]], cut: int) -> None:
    """A streamed prompt's block moves its first layers, then the rest: together, what one
    move of every layer does, each cell once."""
    sources, dests = layout(*src), layout(*dst, first_rank=100)
    for d in dests:
        whole = pieces_for(sources, d)
        parts = restrict(whole, (0, cut)) + restrict(whole, (cut, L))
        cells = sorted((p.src.rank, layer, h) for p in parts for layer in range(*p.layers)
                       for h in range(*p.heads))
        assert cells == sorted((p.src.rank, layer, h) for p in whole
                               for layer in range(*p.layers) for h in range(*p.heads))
        assert all(p.num_layers > 0 for p in parts)
    assert restrict(whole, None) == whole
