"""The C CPU kernels against the PyTorch reference they replace."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.kernels import dispatch, native_cpu
from meshserve.kernels import paged_attention as ref_attention
from meshserve.kernels import rmsnorm as ref_rmsnorm
from meshserve.kernels import rotary as ref_rotary

pytestmark = pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler")


@st.composite
def decode_cases(draw: st.DrawFn) -> dict:
    kv_heads = draw(st.sampled_from([1, 2, 4]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    head_dim = draw(st.sampled_from([8, 12, 32, 64, 80]))
    block_size = draw(st.sampled_from([1, 4, 5, 16]))
    lens = draw(st.lists(st.integers(1, 70), min_size=1, max_size=5))
    window = draw(st.one_of(st.none(), st.integers(1, 40)))
    # Peaked scores (q x 30) make the softmax's running maximum jump from block to block.
    return dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                lens=lens, window=window, q_scale=draw(st.sampled_from([1.0, 30.0])),
                kv_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=60, deadline=None)
@given(decode_cases())
def test_paged_decode_matches_the_reference(case: dict) -> None:
    gen = torch.Generator().manual_seed(case["seed"])
    bs, lens = case["block_size"], case["lens"]
    width = max(-(-n // bs) for n in lens) + 1  # one padding column, as the engine pads
    num_blocks = width * len(lens) + 3
    shape = (num_blocks, bs, case["kv_heads"], case["head_dim"])
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(case["kv_dtype"]) for _ in "kv")
    tables = torch.randperm(num_blocks, generator=gen)[:width * len(lens)].view(len(lens), width)
    # q as the model passes it: a view into a wider fused projection, not contiguous.
    qkv = torch.randn(len(lens), case["heads"] + 3, case["head_dim"], generator=gen)
    qkv *= case["q_scale"]
    q = qkv[:, :case["heads"]]
    context = torch.tensor(lens)
    scale = case["head_dim"] ** -0.5
    want = ref_attention.paged_decode(q, k_cache, v_cache, tables, context, scale,
                                      case["window"])
    got = native_cpu.paged_decode(q, k_cache, v_cache, tables, context, scale, case["window"])
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)  # fp32 sums in another order


@pytest.mark.parametrize("width", [1, 7, 64, 513])
def test_rms_norms_match_the_reference(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x, res = torch.randn(5, width, generator=gen), torch.randn(5, width, generator=gen)
    weight = torch.randn(width, generator=gen)
    torch.testing.assert_close(native_cpu.rms_norm(x, weight, 1e-5),
                               ref_rmsnorm.rms_norm(x, weight, 1e-5))
    got, got_sum = native_cpu.add_rms_norm(x, res, weight, 1e-6)
    want, want_sum = ref_rmsnorm.add_rms_norm(x, res, weight, 1e-6)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_sum, want_sum)


def test_dispatch_takes_them_for_fp32_on_cpu_only_in_auto_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 8)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    dispatch.kernel_mode.cache_clear()
    assert dispatch.use_native(x)
    assert not dispatch.use_native(x.to(torch.bfloat16))
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    dispatch.kernel_mode.cache_clear()
    assert not dispatch.use_native(x)


def test_without_a_compiler_the_reference_stays_and_says_why(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(native_cpu.DIR_VAR, str(tmp_path / "build"))
    native_cpu.library.cache_clear()
    dispatch._native_allowed.cache_clear()
    try:
        assert native_cpu.library() is None
        assert not dispatch.use_native(torch.randn(2, 8))
        assert "native CPU kernels did not build" in capsys.readouterr().err
        assert list((tmp_path / "build").glob("*")) == []  # no half-written library left
    finally:
        native_cpu.library.cache_clear()
        dispatch._native_allowed.cache_clear()


def test_rotary_in_place_equals_the_reference_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(7, 6 + 2, 16, generator=gen)  # 4 q + 2 k heads rotated, 2 v heads not
    cos, sin = torch.randn(7, 8, generator=gen), torch.randn(7, 8, generator=gen)
    want = ref_rotary.apply_rotary(qkv[:, :6], cos, sin)
    v_before = qkv[:, 6:].clone()
    got = native_cpu.rotary_(qkv[:, :6], cos, sin)
    assert got.data_ptr() == qkv.data_ptr() and torch.equal(got, want)
    assert torch.equal(qkv[:, 6:], v_before)


def test_write_kv_stores_strided_rows_at_their_slots() -> None:
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(5, 4 + 2 + 2, 8, generator=gen)
    k, v = qkv[:, 4:6], qkv[:, 6:]
    slots = torch.tensor([3, 17, 0, 9, 30])
    caches = [torch.zeros(4, 8, 2, 8) for _ in range(4)]
    ref_attention.write_kv(k, v, caches[0], caches[1], slots)
    native_cpu.write_kv(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_a_bf16_cache_stores_each_value_rounded_as_torch_rounds_it() -> None:
    """fp32 K/V into a bf16 cache: torch's round-to-nearest-even, bit for bit (ties, values
    that round up to infinity, infinities and subnormals included; NaN stays NaN)."""
    gen = torch.Generator().manual_seed(3)
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.0 - 2**-8, 3.3895314e38,
                            float("inf"), -float("inf"), 1e-40, -0.0])
    k = torch.cat([special, torch.randn(56, generator=gen) * 100]).view(8, 1, 8)
    v = torch.randn(8, 1, 8, generator=gen)
    slots = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])
    caches = [torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16) for _ in range(2)]
    native_cpu.write_kv(k, v, *caches, slots)
    flat_k, flat_v = caches[0].view(8, 1, 8), caches[1].view(8, 1, 8)
    assert torch.equal(flat_k[slots].view(torch.int16), k.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(flat_v[slots].view(torch.int16), v.to(torch.bfloat16).view(torch.int16))
    nan = torch.zeros(1, 1, 8)
    nan[0, 0, 3] = float("nan")
    native_cpu.write_kv(nan, nan, *caches, torch.tensor([0]))
    assert torch.isnan(caches[0][0, 0, 0, 3]) and torch.isnan(caches[1][0, 0, 0, 3])


@settings(max_examples=80, deadline=None)
@given(m=st.integers(1, 13), k=st.integers(1, 70), n=st.integers(1, 40),
       column_major=st.booleans(), x_pad=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_linear_matches_torch_and_a_row_never_depends_on_the_batch(
        m: int, k: int, n: int, column_major: bool, x_pad: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    if column_major:  # the runtime's layout of wide weights: stride (1, n)
        weight = weight.t().contiguous().t()
    x = torch.randn(m, k + x_pad, generator=gen)[:, :k]  # rows with a larger stride
    out = native_cpu.linear(x, weight)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-5,
                               atol=1e-5 * k)
    for i in range(m):  # the same bits whatever else is in the batch
        assert torch.equal(native_cpu.linear(x[i:i + 1], weight)[0], out[i])


@settings(max_examples=80, deadline=None)
@given(m=st.integers(0, 11), k=st.integers(1, 70), n=st.integers(1, 130),
       column_major=st.booleans(), x_pad=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_packed_linear_matches_torch_and_a_row_never_depends_on_the_batch(
        m: int, k: int, n: int, column_major: bool, x_pad: int, seed: int) -> None:
    """Every tile height (1-5 rows; five left over after tiles of four), the one-row
    four-panel and two-row multi-panel paths (n >= 96, n >= 48), a last panel narrower
    than PANEL, and packing from either layout."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    source = weight.t().contiguous().t() if column_major else weight
    packed = native_cpu.pack(source)
    assert packed.shape == ((n + native_cpu.PANEL - 1) // native_cpu.PANEL, k, native_cpu.PANEL)
    assert torch.equal(native_cpu.unpack(packed, n), weight)
    x = torch.randn(m, k + x_pad, generator=gen)[:, :k]
    out = native_cpu.linear_packed(x, packed, n)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-5,
                               atol=1e-5 * k)
    for i in range(m):  # the same bits whatever else is in the batch
        assert torch.equal(native_cpu.linear_packed(x[i:i + 1], packed, n)[0], out[i])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 130), k=st.integers(1, 40), t=st.integers(0, 9),
       seed=st.integers(0, 2**16))
def test_rows_gathered_from_panels_are_the_weight_rows(n: int, k: int, t: int,
                                                       seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    ids = torch.randint(0, n, (t,), generator=gen)
    assert torch.equal(native_cpu.unpack_rows(native_cpu.pack(weight), ids), weight[ids])


@pytest.mark.parametrize("m", [1, 3, 9])
def test_a_packed_linear_on_several_threads_gives_the_same_bits(
        m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_cpu, "THREAD_MIN_FLOPS", 1)  # split even this small one
    weight = torch.randn(100, 37)  # 5 panels, the last narrower: ranges of 1-2 panels
    packed = native_cpu.pack(weight)
    x = torch.randn(m, 37)
    one = native_cpu.linear_packed(x, packed, 100)
    for threads in (2, 3, 5, 8):
        assert torch.equal(native_cpu.linear_packed(x, packed, 100, threads), one), threads


def test_dispatch_takes_a_packed_weight_like_any_other() -> None:
    weight, bias = torch.randn(50, 16), torch.randn(50)
    param = torch.nn.Parameter(weight.clone(), requires_grad=False)
    dispatch.pack_weight(param)
    assert dispatch.packed_columns(param) == 50 and dispatch.out_features(param) == 50
    assert param.dim() == 3
    x = torch.randn(2, 3, 16)  # leading dimensions kept
    expected = torch.nn.functional.linear(x, weight, bias)
    torch.testing.assert_close(dispatch.linear(x, param, bias), expected)
    strided = torch.randn(16, 5).t()  # rows of x not contiguous: copied first
    torch.testing.assert_close(dispatch.linear(strided, param), strided @ weight.t())


def test_a_packed_weight_under_the_reference_kernels_gives_the_same_product(
        monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(30, 8)
    param = torch.nn.Parameter(weight.clone(), requires_grad=False)
    dispatch.pack_weight(param)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    dispatch.kernel_mode.cache_clear()
    assert not dispatch.use_native(param)
    x = torch.randn(3, 8)
    torch.testing.assert_close(dispatch.linear(x, param), x @ weight.t())


def test_dispatch_takes_the_c_linear_in_its_measured_ranges() -> None:
    row_major, column_major = torch.randn(64, 32), torch.randn(32, 64).t()
    assert column_major.stride() == (1, 64)
    lo, hi = dispatch.NATIVE_LINEAR_ROWS
    t_lo, t_hi = dispatch.NATIVE_LINEAR_T_ROWS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows, weight, taken in [(lo, row_major, True), (hi, row_major, True),
                                    (lo - 1, row_major, False), (hi + 1, row_major, False),
                                    (t_lo, column_major, True), (t_hi + 1, column_major, False)]:
            assert dispatch.native_linear_applies(torch.randn(rows, 32), weight) == taken, rows
        assert not dispatch.native_linear_applies(torch.randn(32, 4).t(), row_major[:, :4])
        x = torch.randn(4, 32)
        torch.testing.assert_close(dispatch.linear(x, row_major), x @ row_major.t())
        torch.set_num_threads(2)  # the C kernel is single-threaded: MKL gets the threads
        assert not dispatch.native_linear_applies(torch.randn(lo, 32), row_major)
    finally:
        torch.set_num_threads(threads)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(0, 5), cols=st.integers(1, 70), pad=st.integers(0, 3),
       ties=st.booleans(), nans=st.integers(0, 2), all_inf=st.booleans(),
       seed=st.integers(0, 2**16))
def test_argmax_rows_is_torch_argmax_ties_and_nans_included(
        rows: int, cols: int, pad: int, ties: bool, nans: int, all_inf: bool,
        seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randint(-2, 2, (rows, cols + pad), generator=gen).float() if ties
         else torch.randn(rows, cols + pad, generator=gen))[:, :cols]
    if all_inf and rows:
        x[0] = float("-inf")
    for _ in range(nans if rows else 0):  # a NaN anywhere counts as the largest
        x[int(torch.randint(rows, (1,), generator=gen)),
          int(torch.randint(cols, (1,), generator=gen))] = float("nan")
    assert torch.equal(native_cpu.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(dispatch.argmax_rows(x), x.argmax(dim=-1))


def test_a_forked_child_makes_its_own_linear_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool's threads do not survive fork: the child must not wait on them."""
    monkeypatch.setattr(native_cpu, "THREAD_MIN_FLOPS", 1)
    weight = torch.randn(100, 16)
    packed, x = native_cpu.pack(weight), torch.randn(3, 16)
    expected = native_cpu.linear_packed(x, packed, 100, 2)  # the parent's pool exists now
    pid = os.fork()
    if pid == 0:  # child: exit 0 only if the threaded call completes with the same bits
        ok = torch.equal(native_cpu.linear_packed(x, packed, 100, 2), expected)
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung on its parent's linear threads")
    assert os.waitstatus_to_exitcode(done[1]) == 0


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 20])
def test_bf16_panels_give_the_fp32_kernels_bits_on_the_rounded_weight(m: int) -> None:
    """Decode batches widen each weight vector as they load it, longer ones a few panels at
    a time into scratch; both are the fp32 kernel's product of the weight rounded to bf16,
    bit for bit, on one thread or two; the rows gathered from the panels are its rows."""
    gen = torch.Generator().manual_seed(m)
    n, k = 1000, 256  # a partial last panel; from 8 rows on, enough work for two threads
    w, x = torch.randn(n, k, generator=gen), torch.randn(m, k, generator=gen)
    packed = native_cpu.pack(w, torch.bfloat16)
    assert packed.dtype is torch.bfloat16
    want = native_cpu.linear_packed(x, native_cpu.pack(w.to(torch.bfloat16).float()), n)
    assert torch.equal(native_cpu.linear_packed(x, packed, n), want)
    assert torch.equal(native_cpu.linear_packed(x, packed, n, threads=2), want)
    ids = torch.tensor([0, n - 1, 24, 97])
    assert torch.equal(native_cpu.unpack_rows(packed, ids), w.to(torch.bfloat16).float()[ids])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_on_the_pool_gives_the_same_bits(kv_dtype: torch.dtype) -> None:
    """attend_qkv splits its decode rows over torch's thread count (parts of about equal
    cached tokens): each row exactly as on one thread."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, block = 4, 2, 32, 16
    lens = [900, 40, 1500, 700, 1200, 3]
    blocks = sum(-(-n // block) for n in lens)
    k_cache = torch.randn(blocks, block, kv_heads, d, generator=gen).to(kv_dtype)
    v_cache = torch.randn(blocks, block, kv_heads, d, generator=gen).to(kv_dtype)
    width = max(-(-n // block) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    start = 0
    for r, n in enumerate(lens):
        used = -(-n // block)
        tables[r, :used] = torch.arange(start, start + used)
        start += used
    slots = torch.tensor([int(tables[r, (n - 1) // block]) * block + (n - 1) % block
                          for r, n in enumerate(lens)])
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, d, generator=gen)
    cos, sin = torch.ones(len(lens), d // 2), torch.zeros(len(lens), d // 2)
    context = torch.tensor(lens)

    def run(threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return native_cpu.attend_qkv(qkv.clone(), heads, kv_heads, cos, sin,
                                         k_cache.clone(), v_cache.clone(), slots, tables,
                                         context, d ** -0.5, None)
        finally:
            torch.set_num_threads(before)

    one = run(1)
    for threads in (2, 3):
        assert torch.equal(run(threads), one), threads
