"""Rotary embedding in Triton (rotate-half layout): one program per token and head tile.

cos/sin are the precomputed per-position tables [T, D // 2] (fp32), so linear and llama3
frequency scaling live in the table, not the kernel. The rotation is computed in fp32
and rounded once; the reference rounds each product (a difference of one ulp or so).
"""

from __future__ import annotations

import torch

from meshserve.kernels import checks
from meshserve.kernels.rotary import apply_rotary as apply_rotary_reference
from meshserve.kernels.triton_import import tl, triton

__all__ = ["apply_rotary", "apply_rotary_reference"]


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_heads, stride_xt, stride_xh,
                   stride_ot, stride_oh, stride_ct, stride_st,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < num_heads) & d_mask[None, :]
    cos = tl.load(cos_ptr + t * stride_ct + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    src = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (may be a strided view) by cos/sin [T, D // 2] -> new [T, H, D]."""
    checks.check_dim("x", x, 3)
    checks.check_dtype("x", x, checks.FLOAT_DTYPES)
    checks.check_last_contiguous("x", x)
    t, h, d = x.shape
    if d % 2:
        raise ValueError(f"rotary needs an even head_dim; got {d}")
    checks.check_shape("cos", cos, (t, d // 2))
    checks.check_shape("sin", sin, (t, d // 2))
    checks.check_last_contiguous("cos", cos)
    checks.check_last_contiguous("sin", sin)
    checks.check_same_device(("x", x), ("cos", cos), ("sin", sin))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_h = min(checks.next_pow2(h), 16)
    _rotary_kernel[(t, -(-h // block_h))](
        x, cos, sin, out, h, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos.stride(0), sin.stride(0), HALF=d // 2, BLOCK_HALF=checks.next_pow2(d // 2),
        BLOCK_H=block_h)
    return out
