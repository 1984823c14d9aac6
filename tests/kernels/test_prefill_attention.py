"""The C prompt attention (native_cpu.prefill_attention) against torch's, chunk by chunk:
fp32 exactly as far as summation order allows; with a bf16 cache and output (the AMX or
AVX512_BF16 path, q and P rounded to bf16) no further from the fp32 answer than torch's own
bf16 attention is."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import native_cpu
from meshserve.kernels import paged_attention as ref

pytestmark = pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler")

BLOCK = 16


def _case(heads: int, kv_heads: int, d: int, lens: list[int], starts: list[int],
          kv_dtype: torch.dtype, seed: int = 0) -> dict:
    """Caches holding every chunk's sequence in shuffled blocks, and the step's q."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(n + p) // BLOCK) for n, p in zip(lens, starts)]
    blocks = sum(need) + 3
    k = (torch.randn(blocks, BLOCK, kv_heads, d, generator=g) * 2).to(kv_dtype)
    v = torch.randn(blocks, BLOCK, kv_heads, d, generator=g).to(kv_dtype)
    perm = torch.randperm(blocks, generator=g)
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    total = sum(lens)
    qkv = torch.randn(total, heads + 2 * kv_heads, d, generator=g)  # q is a strided view
    return dict(q=qkv[:, :heads], k=k, v=v, tables=tables, lens=lens, starts=starts)


def _ours(c: dict, out_dtype: torch.dtype, window: int | None,
          variant: int = native_cpu.PREFILL_BEST) -> torch.Tensor:
    q = c["q"]
    out = torch.full((q.shape[0], q.shape[1], q.shape[2]), float("nan"), dtype=out_dtype)
    tables = torch.nn.utils.rnn.pad_sequence(c["tables"], batch_first=True)
    offsets = torch.tensor([0, *c["lens"][:-1]]).cumsum(0)
    assert native_cpu.prefill_attention(q, c["k"], c["v"], tables, offsets,
                                        torch.tensor(c["lens"]), torch.tensor(c["starts"]),
                                        q.shape[2] ** -0.5, window, out, variant)
    return out


def _torch(c: dict, dtype: torch.dtype, window: int | None) -> torch.Tensor:
    """torch's attention per chunk, computing in `dtype` (q, K and V cast to it)."""
    q, outs, at = c["q"], [], 0
    for n, p, table in zip(c["lens"], c["starts"], c["tables"]):
        k, v = c["k"].to(dtype), c["v"].to(dtype)
        outs.append(ref.paged_prefill(q[at:at + n].to(dtype), k, v, table, p,
                                      q.shape[2] ** -0.5, window).float())
        at += n
    return torch.cat(outs)


SHAPES = [(8, 4, 64), (8, 8, 64), (12, 4, 64), (8, 2, 128), (4, 4, 32)]
CHUNKS = [([300], [0]), ([1, 5, 130, 17], [0, 20, 0, 100]), ([64, 200], [64, 7])]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_fp32_output_matches_torch(shape: tuple[int, int, int],
                                   chunks: tuple[list[int], list[int]], window: int | None,
                                   kv_dtype: torch.dtype) -> None:
    c = _case(*shape, *chunks, kv_dtype)
    torch.testing.assert_close(_ours(c, torch.float32, window),
                               _torch(c, torch.float32, window), rtol=1e-4, atol=1e-5)


def _variants() -> list[int]:
    """The variants this CPU runs for a bf16 cache and output (each declines elsewhere)."""
    c = _case(4, 4, 32, [3], [0], torch.bfloat16)
    out = torch.empty(3, 4, 32, dtype=torch.bfloat16)
    return [v for v in native_cpu.PREFILL_VARIANTS.values()
            if native_cpu.prefill_attention(c["q"], c["k"], c["v"], torch.stack(c["tables"]),
                                            torch.tensor([0]), torch.tensor([3]),
                                            torch.tensor([0]), 0.5, None, out, v)]


@pytest.mark.parametrize("variant", _variants() if native_cpu.library() else [])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("window", [None, 37])
def test_bf16_output_is_as_close_as_torch_bf16(variant: int, shape: tuple[int, int, int],
                                               chunks: tuple[list[int], list[int]],
                                               window: int | None) -> None:
    c = _case(*shape, *chunks, torch.bfloat16)
    exact = _torch(c, torch.float32, window)
    ours = _ours(c, torch.bfloat16, window, variant).float()
    theirs = _torch(c, torch.bfloat16, window)
    err, err_torch = (ours - exact).abs(), (theirs - exact).abs()
    assert err.max() <= 2 * err_torch.max() + 1e-3, (err.max(), err_torch.max())
    assert err.mean() <= 2 * err_torch.mean() + 1e-4, (err.mean(), err_torch.mean())


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_two_threads_give_the_same_bits_as_one(out_dtype: torch.dtype) -> None:
    c = _case(8, 4, 64, [1, 5, 130, 300, 17], [0, 20, 0, 40, 100], torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _ours(c, out_dtype, None)
        torch.set_num_threads(2)
        two = _ours(c, out_dtype, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int16 if out_dtype is torch.bfloat16 else torch.int32),
                       two.view(torch.int16 if out_dtype is torch.bfloat16 else torch.int32))


def test_a_head_size_without_a_vector_path_is_declined() -> None:
    c = _case(4, 2, 4, [9], [0], torch.float32)
    out = torch.empty(9, 4, 4)
    tables = torch.stack(c["tables"])
    assert not native_cpu.prefill_attention(c["q"], c["k"], c["v"], tables, torch.tensor([0]),
                                            torch.tensor([9]), torch.tensor([0]), 0.5, None,
                                            out)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 37])
def test_a_prompt_in_chunks_gets_the_same_bits_as_whole(out_dtype: torch.dtype,
                                                        window: int | None) -> None:
    """Each query row's keys are visited in the same tiles whichever chunk it is in."""
    whole = _case(8, 4, 64, [300], [0], torch.bfloat16)
    parts = dict(whole, lens=[100, 77, 123], starts=[0, 100, 177],
                 tables=[whole["tables"][0]] * 3)
    one, three = _ours(whole, out_dtype, window), _ours(parts, out_dtype, window)
    bits = torch.int16 if out_dtype is torch.bfloat16 else torch.int32
    assert torch.equal(one.view(bits), three.view(bits))
