"""The CPU's bf16 paths against torch: SwiGLU and RMSNorm with bf16 at either end, and the
linear of bf16 panels (the C kernel for decode rows, oneDNN's prepacked copy for batches)."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import cpu_isa, dispatch, native_cpu
from meshserve.kernels import rmsnorm as ref_rmsnorm

pytestmark = pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler")

BF16_ULP = 2.0 ** -7
"""A bf16 value's spacing relative to its size (8 bits of mantissa)."""


def close_bf16(got: torch.Tensor, want: torch.Tensor, ulps: float = 1.0) -> None:
    """got within `ulps` bf16 spacings of want, element by element (NaN where NaN)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan())
    g, w = g.nan_to_num(), w.nan_to_num()
    assert ((g - w).abs() <= ulps * BF16_ULP * w.abs() + 1e-30).all(), (g - w).abs().max()


@pytest.mark.parametrize("width", [1, 7, 8, 704, 1411])
def test_silu_mul_bf16_matches_torch(width: int) -> None:
    torch.manual_seed(width)
    x = (torch.randn(9, 2 * width) * 6).bfloat16()
    x[0, 0] = float("nan")
    x[1, 0] = -120.0  # exp(120) overflows fp32: silu is -0
    x[2, 0] = 120.0
    got = native_cpu.silu_mul(x)
    gate, up = x.float().chunk(2, dim=-1)
    want = (torch.nn.functional.silu(gate) * up).bfloat16()  # one rounding, as the kernel
    assert got.dtype is torch.bfloat16
    close_bf16(got, want)
    assert torch.equal(dispatch.silu_and_mul(x).view(torch.int16), got.view(torch.int16))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_mixed_matches_the_reference(x_dtype: torch.dtype,
                                                  out_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 67).to(x_dtype)
    residual, weight = torch.randn(5, 67), torch.rand(67) + 0.5
    out, summed = dispatch.add_rms_norm(x, residual, weight, 1e-5, out_dtype)
    want_out, want_sum = ref_rmsnorm.add_rms_norm(x.float(), residual, weight, 1e-5)
    assert summed.dtype is torch.float32 and torch.equal(summed, want_sum)
    assert out.dtype is out_dtype
    if out_dtype is torch.bfloat16:
        close_bf16(out, want_out.bfloat16())
    else:
        torch.testing.assert_close(out, want_out, rtol=1e-6, atol=1e-6)


def test_rms_norm_writes_bf16_for_the_next_linear() -> None:
    torch.manual_seed(1)
    x, weight = torch.randn(6, 40), torch.rand(40) + 0.5
    got = dispatch.rms_norm(x, weight, 1e-6, torch.bfloat16)
    close_bf16(got, ref_rmsnorm.rms_norm(x, weight, 1e-6).bfloat16())


def packed(n: int, k: int, seed: int = 0) -> tuple[torch.nn.Parameter, torch.Tensor]:
    """(bf16 pair panels of a random [n, k] weight, the weight's bf16 values widened)."""
    torch.manual_seed(seed)
    w = torch.randn(n, k) / k ** 0.5
    param = torch.nn.Parameter(w.clone(), requires_grad=False)
    dispatch.pack_weight(param, torch.bfloat16, bf16_batches=True)
    return param, w.bfloat16().float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17, 64])
def test_bf16_panels_linear(rows: int) -> None:
    param, w = packed(100, 72)
    x = torch.randn(rows, 72)
    bias = torch.randn(100)
    in_bf16 = dispatch.batches_in_bf16(param)
    assert in_bf16 == cpu_isa.bf16_batches()
    assert param.dtype is torch.bfloat16 and param.shape == (7, 36, 32)  # held once: 2 B each
    batched = in_bf16 and rows >= dispatch.BF16_ROWS
    assert dispatch.linear_dtype(x, param) is (torch.bfloat16 if batched else torch.float32)
    got = dispatch.linear(x, param, bias)
    assert got.dtype is torch.float32 and got.shape == (rows, 100)
    if batched:  # activations rounded to bf16, fp32 accumulation and bias, rounded once
        want = x.bfloat16().double() @ w.double().t() + bias.double()
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # fp32 activations against the widened weights
        torch.testing.assert_close(got, x @ w.t() + bias, rtol=1e-5, atol=1e-5)
    low = dispatch.linear(x, param, out_dtype=torch.bfloat16)
    assert low.dtype is torch.bfloat16
    assert torch.equal(low, dispatch.linear(x, param).bfloat16())  # one rounding either way
    if batched:  # each row as alone, whatever the batch around it
        assert torch.equal(dispatch.linear(x[-4:], param, bias), got[-4:])


def test_a_bf16_activation_takes_the_panels_too() -> None:
    param, w = packed(48, 32, seed=3)
    x = torch.randn(2, 32).bfloat16()  # a decode row's bf16 input (o_proj after attention)
    got = dispatch.linear(x, param, out_dtype=torch.float32)
    torch.testing.assert_close(got, x.float() @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_isa.bf16_batches(), reason="needs the avx512 path (AVX512_BF16)")
@pytest.mark.parametrize("variant", sorted(native_cpu.BF16_VARIANTS))
@pytest.mark.parametrize("rows", [1, 7, 16, 33, 100])
def test_bf16_activation_kernels_against_float64(variant: str, rows: int) -> None:
    """AMX (K a multiple of 32) and VDPBF16PS on the same pair panels: the exact product of
    bf16 values, summed in fp32 (far inside a bf16 ulp), plus the bias, rounded once; two
    threads give the same bits; the last 16 - rows % 16 rows padded, never read past x."""
    torch.manual_seed(rows)
    n, k = 300, 96
    param, w = packed(n, k, seed=2)
    x, bias = torch.randn(rows, k).bfloat16(), torch.randn(n)
    want = x.double() @ w.double().t() + bias.double()
    code = native_cpu.BF16_VARIANTS[variant]
    got = native_cpu.linear_bf16(x, param.data, n, bias, torch.float32, variant=code)
    if got is None:
        pytest.skip(f"this CPU has no {variant}")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    low = native_cpu.linear_bf16(x, param.data, n, bias, torch.bfloat16, variant=code)
    assert low is not None and torch.equal(low, got.bfloat16())
    two = native_cpu.linear_bf16(x, param.data, n, bias, torch.float32, threads=2,
                                 variant=code)
    assert two is not None and torch.equal(two, got)


def test_amx_needs_k_in_tiles_of_32() -> None:
    param, _ = packed(20, 40)
    x = torch.randn(5, 40).bfloat16()
    assert native_cpu.linear_bf16(x, param.data, 20, None, torch.float32,
                                  variant=native_cpu.BF16_VARIANTS["amx"]) is None


def test_pair_panels_round_trip() -> None:
    torch.manual_seed(4)
    w = torch.randn(37, 50)
    panels = native_cpu.pack(w, torch.bfloat16)
    assert panels.shape == (3, 25, 32)
    assert torch.equal(native_cpu.unpack(panels, 37), w.bfloat16())
    ids = torch.tensor([[0, 36], [17, 16]])
    assert torch.equal(native_cpu.unpack_rows(panels, ids), w.bfloat16().float()[ids])


def test_row_kernels_split_over_two_threads_give_the_same_bits() -> None:
    """SwiGLU and RMSNorm split their rows over the C pool from ROWS_MIN_VALUES values on:
    each row as alone."""
    torch.manual_seed(3)
    x = (torch.randn(300, 2 * 704) * 4).bfloat16()
    h, residual, weight = torch.randn(300, 512).bfloat16(), torch.randn(300, 512), torch.rand(512)
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out, summed = native_cpu.add_rms_norm_mixed(h, residual, weight, 1e-5,
                                                        torch.bfloat16)
            got.append((native_cpu.silu_mul(x), out, summed))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*got):
        assert torch.equal(a.view(torch.int16) if a.dtype is torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype is torch.bfloat16 else b)
    gate, up = x.float().chunk(2, dim=-1)
    close_bf16(got[1][0], (torch.nn.functional.silu(gate) * up).bfloat16())


@pytest.mark.skipif(not cpu_isa.bf16_batches(), reason="needs the avx512 path (AVX512_BF16)")
@pytest.mark.parametrize("variant", sorted(native_cpu.BF16_VARIANTS))
@pytest.mark.parametrize("rows", [4, 19, 64])
def test_swiglu_in_the_linear_against_float64(variant: str, rows: int) -> None:
    """A merged [gate; up] weight: silu(gate) * up in the same pass, gate and up summed in
    fp32 and never rounded on their own; two threads give the same bits."""
    torch.manual_seed(rows)
    inter, k = 80, 96
    param, w = packed(2 * inter, k, seed=5)
    x, bias = torch.randn(rows, k).bfloat16(), torch.randn(2 * inter)
    gate_up = x.double() @ w.double().t() + bias.double()
    want = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    code = native_cpu.BF16_VARIANTS[variant]
    got = native_cpu.linear_bf16(x, param.data, 2 * inter, bias, torch.float32, variant=code,
                                 swiglu=True)
    if got is None:
        pytest.skip(f"this CPU has no {variant}")
    assert got.shape == (rows, inter)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    two = native_cpu.linear_bf16(x, param.data, 2 * inter, bias, torch.float32, threads=2,
                                 variant=code, swiglu=True)
    assert two is not None and torch.equal(two, got)


def test_swiglu_in_the_linear_only_for_bf16_batches() -> None:
    param, w = packed(64, 32, seed=6)
    few = torch.randn(dispatch.BF16_ROWS - 1, 32)
    assert dispatch.linear_swiglu(few, param, None, torch.bfloat16) is None  # decode rows
    many = torch.randn(dispatch.BF16_ROWS + 5, 32)
    got = dispatch.linear_swiglu(many, param, None, torch.bfloat16)
    if not cpu_isa.bf16_batches():
        assert got is None
        return
    assert got is not None and got.dtype is torch.bfloat16 and got.shape == (9, 32)
    gate_up = many.bfloat16().double() @ w.double().t()
    want = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    torch.testing.assert_close(got.double(), want, rtol=2 * BF16_ULP, atol=1e-3)
