"""Triton small-batch linear (interpreter) against torch's linear, and the dispatch rule."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import dispatch
from meshserve.kernels import triton_gemv as tg

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("m,n,k,bias", [(1, 48, 64, False), (3, 40, 100, True),
                                        (16, 33, 530, False)])  # ragged N and K tiles
def test_matches_reference(close, dtype, m, n, k, bias) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    cfg = tg.GemvConfig(block_n=16, block_k=64)
    out = tg.gemv(x, w, b, cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    close(out, tg.gemv_reference(x.float(), w.float(), None if b is None else b.float()),
          dtype)


def test_errors() -> None:
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="columns"):
        tg.gemv(x, torch.randn(32, 48))
    with pytest.raises(ValueError, match="at most 16"):
        tg.gemv(torch.randn(17, 64), w)
    with pytest.raises(ValueError, match="bias"):
        tg.gemv(x, w, torch.randn(31))
    with pytest.raises(ValueError, match="block_n=8"):
        tg.gemv(x, w, config=tg.GemvConfig(block_n=8))


def test_rules_pick_by_rows_and_weight_size(monkeypatch: pytest.MonkeyPatch) -> None:
    small = tg.GemvConfig(block_n=32, block_k=64)
    monkeypatch.setattr(tg, "RULES", [tg.GemvRule(max_rows=8, max_weight_bytes=64 * 64 * 4,
                                                  config=small)])
    assert tg.rule_for(8, torch.empty(64, 64)) == small
    assert tg.rule_for(9, torch.empty(64, 64)) is None  # too many rows: cuBLAS
    assert tg.rule_for(1, torch.empty(65, 64)) is None  # too big a weight: cuBLAS


def test_dispatch_takes_the_rule(monkeypatch: pytest.MonkeyPatch, close) -> None:
    monkeypatch.setenv(dispatch.ENV_VAR, "triton")
    dispatch.kernel_mode.cache_clear()
    cfg = tg.GemvConfig(block_n=16, block_k=32)
    monkeypatch.setattr(tg, "RULES", [tg.GemvRule(8, 1 << 20, cfg)])
    calls = []
    real = tg.gemv
    monkeypatch.setattr(tg, "gemv", lambda *a: calls.append(a[3]) or real(*a))
    x, w = torch.randn(2, 64), torch.randn(24, 64)
    close(dispatch.linear(x, w), x @ w.t(), F32)
    assert calls == [cfg]
    dispatch.linear(torch.randn(9, 64), w)  # above max_rows: torch
    assert calls == [cfg]


def test_measured_hopper_rules_and_the_cpu_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tg.rule_for(1, torch.empty(64, 64)) is None  # RULES None on a CPU: torch
    monkeypatch.setattr(tg, "RULES", tg.MEASURED_RULES[(9, 0)])

    def w(n: int, k: int) -> torch.Tensor:
        return torch.empty(n, k, dtype=BF16, device="meta")

    o, qkv, gate_up = w(4096, 4096), w(6144, 4096), w(28672, 4096)
    assert tg.rule_for(8, o) == tg.GemvConfig(block_n=32, block_k=512)
    assert tg.rule_for(1, qkv) == tg.GemvConfig(block_n=64, block_k=256)
    assert tg.rule_for(2, qkv) is None and tg.rule_for(9, o) is None
    assert tg.rule_for(1, gate_up) is None
    f32 = torch.empty(4096, 4096, device="meta")  # measured on bf16: float32 stays on cuBLAS
    assert tg.rule_for(1, f32) is None
