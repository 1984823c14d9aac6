"""Triton RMSNorm and fused residual-add RMSNorm (interpreter) against the reference."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import triton_rmsnorm as trn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 96])
def test_matches_reference(close, dtype: torch.dtype, width: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x, res = (torch.randn(5, width, generator=gen).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    close(trn.rms_norm(x, w, 1e-6), trn.rms_norm_reference(x, w, 1e-6), dtype)
    out, new_res = trn.add_rms_norm(x, res, w, 1e-6)
    out_ref, res_ref = trn.add_rms_norm_reference(x, res, w, 1e-6)
    assert out.dtype == dtype and new_res.dtype == dtype
    close(new_res, res_ref, dtype)
    close(out, out_ref, dtype)


def test_strided_rows_and_errors(close) -> None:
    x = torch.randn(4, 128)[:, :64]  # rows 128 apart
    w = torch.ones(64)
    close(trn.rms_norm(x, w, 1e-5), trn.rms_norm_reference(x, w, 1e-5), torch.float32)
    with pytest.raises(ValueError, match="weight"):
        trn.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        trn.add_rms_norm(x, torch.randn(4, 64).half(), w, 1e-5)
