"""Moving whole KV blocks in and out of a rank's paged cache, and resharding them between
tensor-parallel layouts of different sizes (what a KV transfer between a prefill replica
and a decode replica of another TP size needs).

A rank's cache is, per layer, (K, V) of shape [num_blocks, block_size, local_kv_heads,
head_dim]. A packed transfer buffer is [num_layers, 2, n, block_size, local_kv_heads,
head_dim]: the blocks in the order asked for, K then V, every layer of this rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

KVCache = Sequence[tuple[torch.Tensor, torch.Tensor]]


def kv_head_range(rank: int, tp: int, num_kv_heads: int) -> range:
    """The global KV heads rank `rank` of `tp` holds: an even split, or one head
    replicated over tp / num_kv_heads ranks when TP exceeds the heads (as the QKV
    projection shards them)."""
    if tp <= num_kv_heads:
        if num_kv_heads % tp:
            raise ValueError(f"tensor-parallel size {tp} must divide num_key_value_heads="
                             f"{num_kv_heads}")
        per = num_kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % num_kv_heads:
        raise ValueError(f"tensor-parallel size {tp} must divide or be a multiple of "
                         f"num_key_value_heads={num_kv_heads}")
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


def gather_blocks(cache: KVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """The packed buffer of `block_ids` (a copy: the cache may change after)."""
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache[0][0].device)
    return torch.stack([torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                        for k, v in cache])


def scatter_blocks(cache: KVCache, block_ids: Sequence[int], packed: torch.Tensor) -> None:
    """Write a packed buffer into `block_ids` of the cache, in place."""
    k0 = cache[0][0]
    want = (len(cache), 2, len(block_ids), *k0.shape[1:])
    if tuple(packed.shape) != want:
        raise ValueError(f"KV blocks of shape {tuple(packed.shape)} do not fit this cache: "
                         f"it takes {want} for {len(block_ids)} blocks")
    idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=k0.device)
    packed = packed.to(device=k0.device, dtype=k0.dtype)
    for layer, (k, v) in enumerate(cache):
        k.index_copy_(0, idx, packed[layer, 0])
        v.index_copy_(0, idx, packed[layer, 1])


@dataclass(frozen=True)
class HeadPiece:
    """Local KV heads `src` of source rank `src_rank` go to local heads `dst` of the
    destination rank."""

    src_rank: int
    src: slice
    dst: slice


def reshard_plan(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int
                 ) -> list[HeadPiece]:
    """Where destination rank `dst_rank` of `dst_tp` finds each of its KV heads among the
    `src_tp` source ranks: each head from the first source rank holding it, consecutive
    heads of one source rank in one piece."""
    pieces: list[HeadPiece] = []
    src_ranges = [kv_head_range(s, src_tp, num_kv_heads) for s in range(src_tp)]
    for local, head in enumerate(kv_head_range(dst_rank, dst_tp, num_kv_heads)):
        s = next(r for r, heads in enumerate(src_ranges) if head in heads)
        at = head - src_ranges[s].start
        last = pieces[-1] if pieces else None
        if last is not None and last.src_rank == s and last.src.stop == at \
                and last.dst.stop == local:
            pieces[-1] = HeadPiece(s, slice(last.src.start, at + 1),
                                   slice(last.dst.start, local + 1))
        else:
            pieces.append(HeadPiece(s, slice(at, at + 1), slice(local, local + 1)))
    return pieces


def reshard(packed_by_src: Sequence[torch.Tensor], num_kv_heads: int, dst_tp: int,
            dst_rank: int) -> torch.Tensor:
    """The packed buffer destination rank `dst_rank` of `dst_tp` takes, from the packed
    buffers of every source rank (by rank; ranks no piece reads may be None)."""
    plan = reshard_plan(num_kv_heads, len(packed_by_src), dst_tp, dst_rank)
    ref = packed_by_src[plan[0].src_rank]
    local = len(kv_head_range(dst_rank, dst_tp, num_kv_heads))
    out = ref.new_empty((*ref.shape[:4], local, ref.shape[5]))
    for p in plan:
        out[:, :, :, :, p.dst] = packed_by_src[p.src_rank][:, :, :, :, p.src]
    return out
