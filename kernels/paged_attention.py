"""Attention over a paged KV cache (PyTorch reference, the CPU path).

Cache layout per layer: K and V each [num_blocks, block_size, num_kv_heads, head_dim].
A sequence's token at position p lives in block block_table[p // block_size], offset
p % block_size. Queries attend causally to every cached position up to their own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at flat slots [T] of the caches (cast to the caches' dtype)."""
    num_blocks, block_size = k_cache.shape[:2]
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, num_blocks_per_seq] block tables -> [B, num_blocks_per_seq * block_size, Hkv, D]."""
    b, n = block_tables.shape
    # Whole blocks as rows of a 2-D view: index_select copies each row in one piece, twice
    # as fast on the CPU as selecting from the 4-D cache.
    rows = cache.view(cache.shape[0], -1) if cache.is_contiguous() else cache
    return rows.index_select(0, block_tables.reshape(-1)).view(b, n * cache.shape[1],
                                                                *cache.shape[2:])


GROUP_SPREAD = 2.0
"""A decode group's longest context is at most this many times its shortest (in blocks)."""


def length_groups(context_lens: list[int], block_size: int,
                  spread: float = GROUP_SPREAD) -> list[tuple[list[int], int]]:
    """Decode rows grouped by similar context length: (row indices, blocks to read) each.

    Padding every row to the batch's longest context makes a long-tail batch gather and
    attend over up to twice the KV it needs; groups whose lengths differ by at most
    `spread` times bound that waste for a few extra kernel calls.
    """
    blocks = [max(1, -(-n // block_size)) for n in context_lens]
    order = sorted(range(len(blocks)), key=blocks.__getitem__)
    groups: list[tuple[list[int], int]] = []
    rows: list[int] = []
    for i in order:
        if rows and blocks[i] > spread * blocks[rows[0]]:
            groups.append((rows, blocks[rows[-1]]))
            rows = []
        rows.append(i)
    if rows:
        groups.append((rows, blocks[rows[-1]]))
    return groups


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, H, D] -> [B, H, D].

    context_lens [B] counts the cached tokens including the query's own. On the CPU,
    rows are attended in groups of similar length (`length_groups`), each reading only
    as many blocks as its longest row.
    """
    if q.device.type == "cpu" and q.shape[0] > 1:
        groups = length_groups(context_lens.tolist(), k_cache.shape[1])
        if len(groups) > 1:
            out = torch.empty_like(q)
            for rows, n_blocks in groups:
                idx = torch.tensor(rows, dtype=torch.long)
                out.index_copy_(0, idx, _paged_decode_padded(
                    q.index_select(0, idx), k_cache, v_cache,
                    block_tables.index_select(0, idx)[:, :n_blocks],
                    context_lens.index_select(0, idx), scale, sliding_window))
            return out
        n_blocks = groups[0][1]
        block_tables = block_tables[:, :n_blocks]
    return _paged_decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale,
                                sliding_window)


def _paged_decode_padded(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         sliding_window: int | None = None) -> torch.Tensor:
    """Every row padded to the table's width: q [B, H, D] -> [B, H, D]."""
    b, h, d = q.shape
    # [B, Hkv, L, D] (a strided view), in q's dtype where the cache holds another
    k = gather_kv(k_cache, block_tables).transpose(1, 2).to(q.dtype)
    v = gather_kv(v_cache, block_tables).transpose(1, 2).to(q.dtype)
    pos = torch.arange(k.shape[2], device=q.device)
    mask = pos.unsqueeze(0) < context_lens.unsqueeze(1)  # [B, L]
    if sliding_window is not None:
        mask &= pos.unsqueeze(0) > (context_lens.unsqueeze(1) - 1 - sliding_window)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :],
                                         scale=scale, enable_gqa=k.shape[1] != h)
    return out.view(b, h, d)


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, start_pos: int, scale: float,
                  sliding_window: int | None = None) -> torch.Tensor:
    """A chunk of one sequence: q [Q, H, D] at positions start_pos.. -> [Q, H, D].

    The chunk's own K/V must already be written; earlier positions (a previous chunk
    or prefix-cache hits) are read through `block_table` [n] the same way.
    """
    num_q, h, d = q.shape
    ctx = start_pos + num_q
    n_blocks = -(-ctx // k_cache.shape[1])
    table = block_table[:n_blocks].unsqueeze(0)
    k = gather_kv(k_cache, table)[0, :ctx].to(q.dtype)  # [ctx, Hkv, D], in q's dtype
    v = gather_kv(v_cache, table)[0, :ctx].to(q.dtype)
    hkv = k.shape[1]
    q_pos = torch.arange(start_pos, ctx, device=q.device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), attn_mask=mask,
        scale=scale, enable_gqa=hkv != h)
    return out[0].transpose(0, 1)


def causal_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                   sliding_window: int | None = None) -> torch.Tensor:
    """A chunk that starts at position 0 attends only to itself: no cache read needed.

    q [Q, H, D], k and v [Q, Hkv, D] -> [Q, H, D].
    """
    num_q, h = q.shape[:2]
    mask = None
    if sliding_window is not None and num_q > sliding_window:
        pos = torch.arange(num_q, device=q.device)
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)
        mask = (diff >= 0) & (diff < sliding_window)
    out = F.scaled_dot_product_attention(
        _heads_first(q), _heads_first(k), _heads_first(v), attn_mask=mask,
        is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != h)
    return out[0].transpose(0, 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] -> [1, H, T, D]. With the batch dimension, the CPU SDPA takes its fused
    (flash) kernel; 3-D inputs fall back to the unfused one, twice as slow at 512 tokens."""
    return x.transpose(0, 1).unsqueeze(0)
