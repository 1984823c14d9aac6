"""RMSNorm, optionally fused with the residual add (PyTorch reference, the CPU path)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x), computed in fp32 and cast back as Hugging Face does."""
    if x.dtype == torch.float32:  # the common CPU case: skip the round trip
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's residual step."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
