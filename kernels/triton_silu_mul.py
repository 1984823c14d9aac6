"""SwiGLU's activation in Triton: silu(gate) * up in one pass over the merged projection.

PyTorch runs it as two kernels over strided halves (silu, then the product); one kernel
reads [gate | up] once and writes the product. Rounding follows the reference: silu is
computed in fp32 and rounded to the input dtype, then the product is rounded again.
"""

from __future__ import annotations

import torch

from meshserve.kernels import checks
from meshserve.kernels.activation import silu_and_mul as silu_and_mul_reference
from meshserve.kernels.triton_import import tl, triton

__all__ = ["silu_and_mul", "silu_and_mul_reference"]

BLOCK = 1024
"""Columns per program."""


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] ([gate | up], last dim contiguous) -> [T, I], as `silu_and_mul_reference`."""
    checks.check_dim("x", x, 2)
    checks.check_dtype("x", x, checks.FLOAT_DTYPES)
    checks.check_last_contiguous("x", x)
    if x.shape[1] % 2:
        raise ValueError(f"x has {x.shape[1]} columns: allowed is an even number ([gate | up])")
    t, n = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    _silu_mul_kernel[(t, triton.cdiv(n, BLOCK))](x, out, n, x.stride(0), out.stride(0),
                                                 BLOCK=BLOCK)
    return out
