"""Triton SiLU-and-mul (interpreter) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import triton_silu_mul as tsm


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 64), (5, 96), (3, 2 * 1100)])  # 1100 > one block
def test_matches_reference(close, dtype: torch.dtype, rows: int, cols: int) -> None:
    x = (3 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(4))).to(dtype)
    out = tsm.silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (rows, cols // 2)
    close(out, tsm.silu_and_mul_reference(x.float()), dtype)


def test_strided_rows_empty_and_errors(close) -> None:
    x = torch.randn(4, 256)[:, :128]  # rows 256 apart
    close(tsm.silu_and_mul(x), tsm.silu_and_mul_reference(x), torch.float32)
    assert tsm.silu_and_mul(torch.randn(0, 64)).shape == (0, 32)
    with pytest.raises(ValueError, match="even"):
        tsm.silu_and_mul(torch.randn(2, 65))
    with pytest.raises(ValueError, match="x"):
        tsm.silu_and_mul(torch.randn(2, 3, 64))
