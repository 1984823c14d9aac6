"""Triton varlen paged prefill (interpreter) against the per-chunk references."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import paged_attention as ref
from meshserve.kernels import triton_paged_prefill as tpp

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (dtype, num_heads, num_kv_heads, head_dim, block_size, [(start_pos, num_tokens)], window)
CASES = [
    (F32, 4, 4, 64, 16, [(0, 20), (16, 9)], None),  # a whole prompt; a chunk after a cached block
    (F16, 8, 2, 64, 16, [(0, 17), (33, 15)], None),  # GQA 4, ragged chunk edges
    (BF16, 8, 1, 128, 32, [(5, 3), (31, 34)], None),  # GQA 8, head_dim 128, block 32
    (F32, 8, 1, 64, 32, [(0, 40)], 9),  # sliding window inside one chunk
    (F16, 4, 2, 64, 16, [(24, 20)], 7),  # sliding window over cached blocks
]


def _run(cache, chunks, h, d, dtype, window):
    """Triton over all chunks in one launch, and the reference chunk by chunk."""
    gen = torch.Generator().manual_seed(2)
    q_lens = [n for _, n in chunks]
    q_starts = [1 + sum(q_lens[:i]) for i in range(len(chunks))]  # row 0 belongs to no chunk
    q = torch.randn(1 + sum(q_lens), h, d, generator=gen).to(dtype)
    out = torch.zeros_like(q)
    tpp.paged_prefill(q, cache.k_cache, cache.v_cache, cache.block_tables,
                      torch.tensor(q_starts), torch.tensor(q_lens),
                      torch.tensor([s for s, _ in chunks]), max(q_lens), d ** -0.5, window,
                      out=out)
    refs = []
    for i, (start, n) in enumerate(chunks):
        rows = slice(q_starts[i], q_starts[i] + n)
        refs.append(ref.paged_prefill(q[rows].float(), cache.k_cache.float(),
                                      cache.v_cache.float(), cache.block_tables[i], start,
                                      d ** -0.5, window))
    return q, out, q_starts, refs


@pytest.mark.parametrize("dtype,h,hkv,d,bs,chunks,window", CASES)
def test_matches_reference(paged_cache, close, dtype, h, hkv, d, bs, chunks, window) -> None:
    cache = paged_cache([s + n for s, n in chunks], hkv, d, bs, dtype)
    _, out, q_starts, refs = _run(cache, chunks, h, d, dtype, window)
    assert torch.equal(out[0], torch.zeros_like(out[0])), "a row outside every chunk changed"
    for i, (_, n) in enumerate(chunks):
        close(out[q_starts[i]:q_starts[i] + n], refs[i], dtype)


def test_first_chunk_matches_causal_prefill(paged_cache, close) -> None:
    """A chunk at position 0 reads its own K/V from the cache: same as causal attention."""
    cache = paged_cache([21], 2, 64, 16, F32)
    q, out, _, _ = _run(cache, [(0, 21)], 8, 64, F32, None)
    k = ref.gather_kv(cache.k_cache, cache.block_tables)[0, :21]  # [21, Hkv, D]
    v = ref.gather_kv(cache.v_cache, cache.block_tables)[0, :21]
    causal = ref.causal_prefill(q[1:], k, v, 0.125)
    close(out[1:], causal, F32)


def test_launcher_errors(paged_cache) -> None:
    cache = paged_cache([20], 2, 64, 16, F32)
    q = torch.randn(20, 8, 64)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="q_lens"):
        tpp.paged_prefill(q, cache.k_cache, cache.v_cache, cache.block_tables, one,
                          torch.tensor([20, 1]), one, 20, 0.125)
    with pytest.raises(ValueError, match="dtype"):
        tpp.paged_prefill(q.half(), cache.k_cache, cache.v_cache, cache.block_tables, one,
                          torch.tensor([20]), one, 20, 0.125)
