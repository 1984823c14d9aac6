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
    """Store k, v [T, Hkv, D] at flat slots [T] of the caches."""
    num_blocks, block_size = k_cache.shape[:2]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, num_blocks_per_seq] block tables -> [B, num_blocks_per_seq * block_size, Hkv, D]."""
    b, n = block_tables.shape
    return cache.index_select(0, block_tables.reshape(-1)).view(b, n * cache.shape[1],
                                                                 *cache.shape[2:])


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, H, D] -> [B, H, D].

    context_lens [B] counts the cached tokens including the query's own.
    """
    b, h, d = q.shape
    k = gather_kv(k_cache, block_tables).transpose(1, 2)  # [B, Hkv, L, D] (a strided view)
    v = gather_kv(v_cache, block_tables).transpose(1, 2)
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
    k = gather_kv(k_cache, block_table[:n_blocks].unsqueeze(0))[0, :ctx]  # [ctx, Hkv, D]
    v = gather_kv(v_cache, block_table[:n_blocks].unsqueeze(0))[0, :ctx]
    hkv = k.shape[1]
    q_pos = torch.arange(start_pos, ctx, device=q.device).unsqueeze(1)
    k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        scale=scale, enable_gqa=hkv != h)
    return out.transpose(0, 1)


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
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        is_causal=mask is None, scale=scale, enable_gqa=k.shape[1] != h)
    return out.transpose(0, 1)
