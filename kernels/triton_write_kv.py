"""KV write in Triton: this step's k and v rows stored at their flat cache slots.

Grid (token, kv-head tile). A slot < 0 is skipped: CUDA-graph padding rows carry -1 so
they never touch a live block. k and v may be strided views (slices of the fused QKV).
"""

from __future__ import annotations

import torch

from meshserve.kernels import checks
from meshserve.kernels.paged_attention import write_kv as write_kv_reference
from meshserve.kernels.triton_import import tl, triton

__all__ = ["write_kv", "write_kv_reference"]


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, num_kv_heads,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    live = (offs_h[:, None] * 0 + slot) >= 0  # a tensor, not a scalar: the interpreter needs it
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM) & live
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                mask=mask)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :],
                mask=mask)
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at flat slots [T] of the caches; slots < 0 are skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = checks.check_cache(k_cache, v_cache)
    checks.check_dim("k", k, 3)
    checks.check_shape("k", k, (k.shape[0], num_kv_heads, head_dim))
    checks.check_shape("v", v, tuple(k.shape))
    checks.check_same_dtype("k", k, "k_cache", k_cache)
    checks.check_same_dtype("v", v, "k_cache", k_cache)
    checks.check_last_contiguous("k", k)
    checks.check_last_contiguous("v", v)
    checks.check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    checks.check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    checks.check_same_device(("k", k), ("v", v), ("k_cache", k_cache),
                             ("slot_mapping", slot_mapping))
    if k.shape[0] == 0:
        return
    block_h = min(checks.next_pow2(num_kv_heads), 8)
    grid = (k.shape[0], -(-num_kv_heads // block_h))
    # A flat slot addresses token rows: the cache's (block, offset) strides fold into one.
    _write_kv_kernel[grid](k, v, k_cache, v_cache, slot_mapping, num_kv_heads,
                           k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           k_cache.stride(1), k_cache.stride(2), HEAD_DIM=head_dim,
                           BLOCK_D=checks.next_pow2(head_dim), BLOCK_H=block_h)
