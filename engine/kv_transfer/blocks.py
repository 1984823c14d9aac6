"""Moving whole KV blocks in and out of a rank's paged cache, and which KV heads a
tensor-parallel rank holds (engine/kv_transfer/pieces.py cuts transfers between layouts of
different sizes from them).

A rank's cache is, per layer, (K, V) of shape [num_blocks, block_size, local_kv_heads,
head_dim]. A packed transfer buffer is [num_layers, 2, n, block_size, local_kv_heads,
head_dim]: the blocks in the order asked for, K then V, every layer of this rank.
"""

from __future__ import annotations

from collections.abc import Sequence

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
