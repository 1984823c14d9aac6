"""Triton KV write (interpreter) against index_copy_."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import triton_write_kv as twk


@pytest.mark.parametrize("dtype,hkv,d,bs", [(torch.float32, 2, 64, 16),
                                            (torch.float16, 1, 128, 32),
                                            (torch.bfloat16, 8, 64, 16)])
def test_matches_reference_from_strided_qkv(dtype: torch.dtype, hkv: int, d: int,
                                            bs: int) -> None:
    """k and v are slices of the fused QKV; every slot is written exactly, -1 is skipped."""
    qkv = torch.randn(6, 4 * hkv, d).to(dtype)
    k, v = qkv[:, 2 * hkv:3 * hkv], qkv[:, 3 * hkv:]
    slots = torch.tensor([0, bs - 1, bs, 3 * bs + 5, -1, 2 * bs + 1])
    shape = (4, bs, hkv, d)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    twk.write_kv(k, v, k_cache, v_cache, slots)
    live = slots >= 0
    twk.write_kv_reference(k[live], v[live], k_ref, v_ref, slots[live])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_launcher_errors() -> None:
    cache = torch.zeros(2, 16, 2, 64)
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        twk.write_kv(k, k, cache, cache.clone(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="dtype"):
        twk.write_kv(k.half(), k.half(), cache, cache.clone(), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.zeros(2, 2, 16, 64).transpose(1, 2)  # [2, 16, 2, 64], not contiguous
        twk.write_kv(k, k, strided, strided.clone(), torch.tensor([0, 1, 2]))
