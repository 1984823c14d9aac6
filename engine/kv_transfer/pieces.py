"""Which rank's KV goes where when a prompt's blocks move between replicas of different
layouts: a prefill replica of tp=2 and a decode replica of tp=1, a pipeline of two stages
on one side and none on the other.

Every rank holds a rectangle of the model's KV: a range of layers (its pipeline stage)
by a range of KV heads (its tensor-parallel share), for every block. A destination rank
takes each layer and head it holds from exactly one source rank: of the source ranks
holding it (heads are replicated when TP exceeds them), the first. For one source and one
destination the shared layers and heads are each a contiguous range, so every
source-destination pair moves at most one piece: layers x heads x the blocks asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshserve.engine.kv_transfer.blocks import KVCache, kv_head_range


@dataclass(frozen=True)
class RankKV:
    """The part of the model's KV one rank holds. `rank` names it among every rank that
    moves KV (all replicas'); `layers` and `heads` are global [start, stop) ranges."""

    rank: int
    layers: tuple[int, int]
    heads: tuple[int, int]

    @classmethod
    def of(cls, rank: int, layers: tuple[int, int], tp_rank: int, tp: int,
           num_kv_heads: int) -> RankKV:
        h = kv_head_range(tp_rank, tp, num_kv_heads)
        return cls(rank, (layers[0], layers[1]), (h.start, h.stop))


@dataclass(frozen=True)
class Piece:
    """Global layers and heads that source rank `src` sends to destination rank `dst`."""

    src: RankKV
    dst: RankKV
    layers: tuple[int, int]
    heads: tuple[int, int]

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def within(self, layers: tuple[int, int]) -> Piece | None:
        """This piece over the global layers [start, stop) only (None: it holds none)."""
        cut = _overlap(self.layers, layers)
        return None if cut is None else Piece(self.src, self.dst, cut, self.heads)

    def local(self, side: RankKV) -> tuple[slice, slice]:
        """This piece's layers and heads in `side`'s own cache (its source or destination)."""
        return (slice(self.layers[0] - side.layers[0], self.layers[1] - side.layers[0]),
                slice(self.heads[0] - side.heads[0], self.heads[1] - side.heads[0]))


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def pieces_for(sources: Sequence[RankKV], dst: RankKV) -> list[Piece]:
    """What `dst` takes from each of `sources` (one replica's ranks): every layer and head
    of `dst` exactly once, from the first source holding it. Raises ValueError when the
    sources miss part of it."""
    out: list[Piece] = []
    for layer_lo, layer_hi in _stage_ranges(sources, dst.layers):
        head = dst.heads[0]
        while head < dst.heads[1]:
            src = next((s for s in sources if s.layers[0] <= layer_lo < s.layers[1]
                        and s.heads[0] <= head < s.heads[1]), None)
            if src is None:
                raise ValueError(f"no source rank holds layer {layer_lo}, KV head {head} "
                                 f"(sources: {list(sources)})")
            stop = min(src.heads[1], dst.heads[1])
            out.append(Piece(src, dst, (layer_lo, min(layer_hi, src.layers[1])),
                             (head, stop)))
            head = stop
    return out


def _stage_ranges(sources: Sequence[RankKV], want: tuple[int, int]) -> list[tuple[int, int]]:
    """`want` cut where the sources' layer ranges start and end."""
    cuts = sorted({want[0], want[1]} | {b for s in sources for b in s.layers
                                        if want[0] < b < want[1]})
    return list(zip(cuts, cuts[1:], strict=False))


def restrict(pieces: Sequence[Piece], layers: tuple[int, int] | None) -> list[Piece]:
    """`pieces` over the global layers [start, stop) only, the empty ones dropped (None:
    all their layers)."""
    if layers is None:
        return list(pieces)
    return [q for p in pieces if (q := p.within(layers)) is not None]


def pieces_from(src: RankKV, sources: Sequence[RankKV], dests: Sequence[RankKV]) -> list[Piece]:
    """What source rank `src` (one of `sources`) sends to each of `dests`."""
    return [p for d in dests for p in pieces_for(sources, d) if p.src == src]


def layer_shape(cache: KVCache, piece: Piece, num_blocks: int) -> tuple[int, ...]:
    """The shape of one layer of `piece` over `num_blocks` blocks: [2, n, block_size, heads,
    head_dim], K then V."""
    k = cache[0][0]
    return (2, num_blocks, k.shape[1], piece.heads[1] - piece.heads[0], k.shape[3])


def piece_shape(cache: KVCache, piece: Piece, num_blocks: int) -> tuple[int, ...]:
    """The shape `pack` gives for `piece` over `num_blocks` blocks: its layers of
    `layer_shape`."""
    return (piece.num_layers, *layer_shape(cache, piece, num_blocks))


def block_index(cache: KVCache, blocks: Sequence[int]) -> torch.Tensor:
    """Block ids as an index tensor on the cache's device (made once per transfer)."""
    return torch.as_tensor(list(blocks), dtype=torch.long, device=cache[0][0].device)


def pack_layer(cache: KVCache, me: RankKV, piece: Piece,
               blocks: Sequence[int] | torch.Tensor, layer: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The piece's `layer`-th layer (counted from its first) of `blocks` from this rank's
    cache, shaped as `layer_shape` (a copy: the cache may change after); into `out` if
    given (host memory for a GPU cache: staged through the device)."""
    layers, heads = piece.local(me)
    k, v = cache[layers.start + layer]
    idx = blocks if isinstance(blocks, torch.Tensor) else block_index(cache, blocks)
    shape = layer_shape(cache, piece, len(idx))
    into = out if out is not None and out.device == k.device else torch.empty(
        shape, dtype=k.dtype, device=k.device)
    for i, t in enumerate((k, v)):
        if heads == slice(0, t.shape[2]):
            torch.index_select(t, 0, idx, out=into[i])
        else:
            into[i].copy_(t.index_select(0, idx)[:, :, heads])
    if out is not None and into is not out:
        out.copy_(into)
    return out if out is not None else into


def pack(cache: KVCache, me: RankKV, piece: Piece, blocks: Sequence[int]) -> torch.Tensor:
    """The piece's KV of `blocks` from this rank's cache, shaped as `piece_shape` (a copy)."""
    idx = block_index(cache, blocks)
    return torch.stack([pack_layer(cache, me, piece, idx, i)
                        for i in range(piece.num_layers)])


def unpack_layer(cache: KVCache, me: RankKV, piece: Piece,
                 blocks: Sequence[int] | torch.Tensor, layer: int,
                 packed: torch.Tensor) -> None:
    """Write one packed layer (`layer_shape`) of the piece into `blocks` of this rank's
    cache, in place."""
    want = layer_shape(cache, piece, len(blocks))
    if tuple(packed.shape) != want:
        raise ValueError(f"a KV layer of shape {tuple(packed.shape)} does not fit: this rank "
                         f"takes {want} for {len(blocks)} blocks")
    layers, heads = piece.local(me)
    k, v = cache[layers.start + layer]
    idx = blocks if isinstance(blocks, torch.Tensor) else block_index(cache, blocks)
    packed = packed.to(device=k.device, dtype=k.dtype)
    for t, part in ((k, packed[0]), (v, packed[1])):
        if heads == slice(0, t.shape[2]):
            t.index_copy_(0, idx, part)
        else:
            t[:, :, heads].index_copy_(0, idx, part)  # a view: writes through


def unpack(cache: KVCache, me: RankKV, piece: Piece, blocks: Sequence[int],
           packed: torch.Tensor) -> None:
    """Write a packed piece (`piece_shape`) into `blocks` of this rank's cache, in place."""
    want = piece_shape(cache, piece, len(blocks))
    if tuple(packed.shape) != want:
        raise ValueError(f"a KV piece of shape {tuple(packed.shape)} does not fit: this rank "
                         f"takes {want} for {len(blocks)} blocks")
    idx = block_index(cache, blocks)
    for i in range(want[0]):
        unpack_layer(cache, me, piece, idx, i, packed[i])


def by_layer(pieces: Sequence[Piece]) -> list[tuple[Piece, int]]:
    """Every (piece, layer) of `pieces`, layer by layer: the order a transfer moves them in,
    the same on both sides."""
    return [(p, layer) for layer in range(max((p.num_layers for p in pieces), default=0))
            for p in pieces if layer < p.num_layers]
