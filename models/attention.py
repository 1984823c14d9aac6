"""Attention over the paged KV cache, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from meshserve.kernels import dispatch


@dataclass
class PrefillChunk:
    """One sequence's prompt chunk inside the step's flattened tokens."""

    token_start: int
    """Index of the chunk's first token among the step's tokens."""
    num_tokens: int
    """Tokens in the chunk."""
    start_pos: int
    """Position of the chunk's first token in its sequence."""
    block_table: torch.Tensor
    """The sequence's blocks [n] (long)."""


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the KV cache and what each attends to.

    Tokens are ordered decodes first (one per sequence), then prefill chunks.
    """

    slot_mapping: torch.Tensor
    """Flat cache slot of every token [T] (long)."""
    num_decode_tokens: int
    """The first this-many tokens are decodes."""
    decode_block_tables: torch.Tensor
    """[num_decode, max_blocks] (long), padded with 0."""
    decode_context_lens: torch.Tensor
    """[num_decode] cached tokens including the decoded one."""
    prefills: list[PrefillChunk]
    """The prompt chunks after the decodes."""
    prefill_batch: dispatch.PrefillBatch | None = None
    """The chunks stacked for the Triton prefill kernel: built by the step's first layer."""


class Attention(nn.Module):
    """Writes this step's K/V to its layer's cache, then attends through block tables."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Point this layer at its K and V cache [num_blocks, block_size, Hkv, D]."""
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    meta: AttentionMetadata, out_dtype: torch.dtype | None = None
                    ) -> torch.Tensor:
        """qkv [T, H + 2 Hkv, D], the fused projection (this call may overwrite it): rotate
        q and k by cos/sin [T, D/2], store K/V, attend -> [T, H, D]. `out_dtype` bf16 (the
        next linear rounds its input so anyway) lets the prompts' attention compute in bf16
        over a bf16 cache (dispatch.prefill)."""
        h, hkv = self.num_heads, self.num_kv_heads
        decoded = dispatch.attend_qkv(qkv, h, hkv, cos, sin, self.k_cache, self.v_cache, meta,
                                      self.scale, self.sliding_window)
        if decoded is None:  # the step by step path
            qk = dispatch.apply_rotary(qkv[:, :h + hkv], cos, sin)  # q and k in one call
            return self(qk[:, :h], qk[:, h:], qkv[:, h + hkv:], meta)
        if not meta.prefills:
            return decoded
        out = torch.empty_like(qkv[:, :h], dtype=out_dtype or qkv.dtype)
        out[:meta.num_decode_tokens] = decoded
        meta.prefill_batch = dispatch.prefill(qkv[:, :h], qkv[:, h:h + hkv], qkv[:, h + hkv:],
                                              self.k_cache, self.v_cache, meta.prefills, out,
                                              self.scale, self.sliding_window,
                                              meta.prefill_batch)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, D], k and v [T, Hkv, D] -> [T, H, D]."""
        dispatch.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        n_dec = meta.num_decode_tokens
        if not meta.prefills:
            return self._decode(q, meta)
        out = torch.empty_like(q)
        if n_dec:
            out[:n_dec] = self._decode(q[:n_dec], meta)
        meta.prefill_batch = dispatch.prefill(q, k, v, self.k_cache, self.v_cache, meta.prefills,
                                              out, self.scale, self.sliding_window,
                                              meta.prefill_batch)
        return out

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return dispatch.paged_decode(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                     meta.decode_context_lens, self.scale, self.sliding_window)
