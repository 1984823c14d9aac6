"""Triton rotary (interpreter) against the reference, on llama3-scaled cos/sin tables."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import triton_rotary as trot
from meshserve.models.rope import RotaryEmbedding

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("dtype,d,scaling", [(torch.float32, 64, LLAMA3),
                                             (torch.float16, 128, {}),
                                             (torch.bfloat16, 128, LLAMA3)])
def test_matches_reference(close, dtype: torch.dtype, d: int, scaling: dict) -> None:
    rope = RotaryEmbedding(d, 512, 500000.0, scaling)
    cos, sin = rope.lookup(torch.tensor([0, 1, 17, 63, 64, 300, 511]))
    qkv = torch.randn(7, 12, d).to(dtype)
    qk = qkv[:, :10]  # q and k heads of a fused QKV: a strided view
    out = trot.apply_rotary(qk, cos, sin)
    assert out.dtype == dtype and out.is_contiguous()
    close(out, trot.apply_rotary_reference(qk, cos, sin), dtype)


def test_launcher_errors() -> None:
    x = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="cos"):
        trot.apply_rotary(x, torch.randn(3, 16), torch.randn(3, 32))
    with pytest.raises(ValueError, match="even"):
        trot.apply_rotary(torch.randn(3, 2, 63), torch.randn(3, 31), torch.randn(3, 31))
