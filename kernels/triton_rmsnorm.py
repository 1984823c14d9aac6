"""RMSNorm in Triton, optionally fused with the residual add: one program per row.

Rounding follows the reference (Hugging Face's): the sum x + residual is rounded to the
input dtype, normalised in fp32, rounded again, then multiplied by the weight.
"""

from __future__ import annotations

import torch

from meshserve.kernels import checks
from meshserve.kernels.rmsnorm import add_rms_norm as add_rms_norm_reference
from meshserve.kernels.rmsnorm import rms_norm as rms_norm_reference
from meshserve.kernels.triton_import import tl, triton

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, n_cols,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    checks.check_dtype("x", x, checks.FLOAT_DTYPES)
    checks.check_dim("x", x, 2)
    checks.check_last_contiguous("x", x)
    checks.check_shape("weight", weight, (x.shape[1],))
    checks.check_contiguous("weight", weight)
    checks.check_same_device(("x", x), ("weight", weight))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, res_out: torch.Tensor | None) -> torch.Tensor:
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    res = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    _rms_norm_kernel[(x.shape[0],)](
        x, res, weight, out, ro, eps, x.shape[1], x.stride(0), res.stride(0), out.stride(0),
        ro.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=checks.next_pow2(x.shape[1]))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> weight * x / rms(x), as `rms_norm_reference`."""
    _check(x, weight)
    return _launch(x, None, weight, eps, None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over x and residual [T, N]."""
    _check(x, weight)
    checks.check_shape("residual", residual, tuple(x.shape))
    checks.check_same_dtype("residual", residual, "x", x)
    checks.check_last_contiguous("residual", residual)
    checks.check_same_device(("x", x), ("residual", residual))
    res_out = torch.empty_like(x)
    return _launch(x, residual, weight, eps, res_out), res_out
