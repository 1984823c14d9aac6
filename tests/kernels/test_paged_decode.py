"""Triton paged decode (interpreter) against the SDPA reference."""

from __future__ import annotations

import pytest
import torch

from meshserve.kernels import triton_paged_decode as tpd

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (dtype, num_heads, num_kv_heads, head_dim, block_size, context lengths, partition, window)
CASES = [
    (F32, 4, 4, 64, 16, [1, 16, 17, 40], 512, None),  # MHA, lengths around block edges
    (F16, 8, 2, 64, 16, [15, 33], 512, None),  # GQA 4
    (BF16, 8, 1, 128, 32, [31, 32, 65], 512, None),  # GQA 8, head_dim 128
    (F32, 8, 1, 64, 16, [5, 70, 100], 32, None),  # split-K: 2 blocks per split
    (BF16, 4, 1, 128, 32, [64, 130], 64, None),  # split-K, bf16, a split left empty
    (F16, 4, 1, 64, 32, [97], 32, None),  # one split per block
    (F32, 8, 2, 64, 16, [3, 50, 90], 512, 20),  # sliding window
    (F32, 8, 2, 64, 16, [3, 50, 90], 32, 20),  # sliding window across splits
]


@pytest.mark.parametrize("per_iter", [0, 128])  # one block per step; the default gather
@pytest.mark.parametrize("dtype,h,hkv,d,bs,lens,partition,window", CASES)
def test_matches_reference(paged_cache, close, dtype, h, hkv, d, bs, lens, partition,
                           window, per_iter) -> None:
    cache = paged_cache(lens, hkv, d, bs, dtype)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(1)).to(dtype)
    ctx = torch.tensor(lens)
    out = tpd.paged_decode(q, cache.k_cache, cache.v_cache, cache.block_tables, ctx,
                           d ** -0.5, window, partition_tokens=partition,
                           config=tpd.DecodeConfig(tokens_per_iter=per_iter))
    ref = tpd.paged_decode_reference(q.float(), cache.k_cache.float(), cache.v_cache.float(),
                                     cache.block_tables, ctx, d ** -0.5, window)
    assert out.dtype == dtype and out.shape == q.shape
    close(out, ref, dtype)


@pytest.mark.parametrize("partition", [512, 32])
def test_padding_rows_give_zeros(paged_cache, partition: int) -> None:
    """CUDA-graph padding: context length 0 and table of zeros -> a zero row, never NaN."""
    cache = paged_cache([40, 1], 2, 64, 16, F32)
    q = torch.randn(2, 4, 64)
    out = tpd.paged_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                           torch.tensor([40, 0]), 0.125, partition_tokens=partition)
    assert torch.equal(out[1], torch.zeros(4, 64))
    assert torch.isfinite(out).all()


# (dtype, num_heads, num_kv_heads, head_dim, block_size, lengths, partition, window, per_iter)
GATHER_CASES = [
    (F32, 4, 4, 64, 16, [1, 16, 17, 40, 70], 512, None, 64),  # 4 blocks per loop step
    (BF16, 8, 1, 128, 32, [31, 33, 130], 512, None, 128),
    (F16, 8, 2, 64, 16, [5, 70, 100], 64, None, 32),  # split-K with 2-block steps
    (F32, 8, 2, 64, 16, [3, 50, 90], 512, 20, 32),  # a window starting mid-step
    (F32, 8, 2, 64, 16, [3, 50, 90], 64, 37, 64),  # a window across splits
]


@pytest.mark.parametrize("dtype,h,hkv,d,bs,lens,partition,window,per_iter", GATHER_CASES)
def test_several_blocks_per_step_match_reference(paged_cache, close, dtype, h, hkv, d, bs,
                                                 lens, partition, window, per_iter) -> None:
    cache = paged_cache(lens, hkv, d, bs, dtype)
    q = torch.randn(len(lens), h, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    ctx = torch.tensor(lens)
    cfg = tpd.DecodeConfig(partition_tokens=partition, tokens_per_iter=per_iter)
    out = tpd.paged_decode(q, cache.k_cache, cache.v_cache, cache.block_tables, ctx,
                           d ** -0.5, window, config=cfg)
    ref = tpd.paged_decode_reference(q.float(), cache.k_cache.float(), cache.v_cache.float(),
                                     cache.block_tables, ctx, d ** -0.5, window)
    close(out, ref, dtype)


@pytest.mark.parametrize("per_iter", [24, 8, 48])
def test_tokens_per_iter_errors(paged_cache, per_iter: int) -> None:
    cache = paged_cache([20, 7], 2, 64, 16, F32)
    with pytest.raises(ValueError, match=f"tokens_per_iter={per_iter}"):
        tpd.paged_decode(torch.randn(2, 4, 64), cache.k_cache, cache.v_cache,
                         cache.block_tables, torch.tensor([20, 7]), 0.125,
                         config=tpd.DecodeConfig(tokens_per_iter=per_iter))


def test_int32_tables_and_strided_q(paged_cache, close) -> None:
    cache = paged_cache([20, 7], 2, 64, 16, F32)
    qkv = torch.randn(2, 8, 64)
    q = qkv[:, :4]  # a view with the fused QKV's row stride
    tables, ctx = cache.block_tables.int(), torch.tensor([20, 7], dtype=torch.int32)
    out = tpd.paged_decode(q, cache.k_cache, cache.v_cache, tables, ctx, 0.125)
    ref = tpd.paged_decode_reference(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                     ctx.long(), 0.125)
    close(out, ref, F32)


def test_num_splits_for() -> None:
    assert tpd.num_splits_for(1, 16) == (1, 64)
    assert tpd.num_splits_for(64, 16) == (1, 64)
    assert tpd.num_splits_for(65, 16) == (2, 64)
    assert tpd.num_splits_for(10, 32, partition_tokens=64) == (5, 2)
    assert tpd.num_splits_for(8192, 16) == (32, 256)  # 128k tokens: capped at MAX_SPLITS


def test_plan_splits_shrinks_the_partition_for_small_grids() -> None:
    cpu = torch.device("cpu")
    cfg = tpd.DecodeConfig(partition_tokens=1024, tokens_per_iter=128, min_programs=264)
    # batch 1 x 8 kv heads, 37-block tables: 1024 -> 128-token splits (5), not below a step
    assert tpd.plan_splits(37, 16, 8, cfg, cpu) == (5, 8)
    # batch 64 x 8 heads fill the grid already: the configured partition stays
    assert tpd.plan_splits(256, 16, 512, cfg, cpu) == (4, 64)
    # no target (the CPU default): as configured
    assert tpd.plan_splits(37, 16, 8, tpd.DecodeConfig(min_programs=-1), cpu) == (1, 64)


@pytest.mark.parametrize("change,match", [
    (dict(q_dtype=F16), "dtype"),
    (dict(head_dim=32), "head_dim"),
    (dict(block_size=8), "block_size"),
    (dict(num_heads=6), "multiple of num_kv_heads"),
    (dict(lens_rows=3), "context_lens"),
])
def test_launcher_errors(paged_cache, change: dict, match: str) -> None:
    bs = change.get("block_size", 16)
    cache = paged_cache([20, 7], 4, 64, bs, F32)
    q = torch.randn(2, change.get("num_heads", 8), change.get("head_dim", 64))
    q = q.to(change.get("q_dtype", F32))
    ctx = torch.tensor([20, 7, 1][:change.get("lens_rows", 2)])
    with pytest.raises(ValueError, match=match):
        tpd.paged_decode(q, cache.k_cache, cache.v_cache, cache.block_tables, ctx, 0.125)
