"""SwiGLU's activation, the PyTorch reference (the CPU path): silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] holding [gate | up] -> silu(gate) * up [T, I], rounded as PyTorch rounds
    each op (silu to x's dtype, then the product)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
