"""Paged-attention decode in Triton: one query token per sequence, K/V through block tables.

Grid (batch, kv_head, split). A program serves every query head of one KV head (GQA: the
group's queries share each K/V load, so the cache is read once per KV head) over one
split of the context: `blocks_per_split` cache blocks, online softmax in fp32. With more
than one split, each writes its unnormalised output and (max, sum) to a scratch buffer
and a second kernel merges them (split-K: long contexts keep every SM busy at batch 1).
The split count comes from the block table's width, never from the context lengths, so
a launch needs no host sync and is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from meshserve.kernels import checks
from meshserve.kernels.paged_attention import paged_decode as paged_decode_reference
from meshserve.kernels.triton_import import dot_config, tl, triton
from meshserve.kernels.triton_online_softmax import attend_block

__all__ = ["DecodeConfig", "paged_decode", "paged_decode_reference", "num_splits_for",
           "plan_splits"]

PARTITION_TOKENS = 1024
"""Cache tokens per split (a multiple of any supported block size)."""

MAX_SPLITS = 32
"""Most splits of one sequence's context."""


@dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs of the decode kernel. The defaults are the fastest of the device check's
    sweep on an H200 (Llama-3-8B heads, batch 64 x 4096 tokens: 81% of copy bandwidth)."""

    partition_tokens: int = PARTITION_TOKENS
    """Cache tokens per split, before shrinking for `min_programs`."""
    tokens_per_iter: int = 128
    """Cache tokens folded per loop step: 0 is one cache block; else a power of two of at
    least the block size (rows gathered over several blocks), capped at the split's size."""
    num_warps: int | None = 4
    """Triton's default when None."""
    num_stages: int | None = 4
    min_programs: int = -1
    """Halve the split size (down to one loop step) while batch x kv heads x splits is below
    this, so a small batch still fills the GPU; -1 is twice the SM count on CUDA, none on CPU."""


CONFIG = DecodeConfig()
"""What `paged_decode` launches with unless given a config."""

MIN_BLOCK_SIZE = 16
"""tl.dot needs tiles of at least 16 on the GPU; smaller cache blocks use the reference."""

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr,
                   qk_scale, window, stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_kb, stride_kt, stride_kh, stride_tb,
                   GQA: tl.constexpr, GQA_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCKS_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   TOKENS_PER_ITER: tl.constexpr, USE_WINDOW: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b).to(tl.int32)
    offs_g = tl.arange(0, GQA_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_SIZE)
    g_mask = offs_g < GQA
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GQA + offs_g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G, D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([GQA_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GQA_PAD], tl.float32)
    acc = tl.zeros([GQA_PAD, BLOCK_D], tl.float32)
    if TOKENS_PER_ITER == BLOCK_SIZE:  # one cache block per step: one table entry
        lo = split * BLOCKS_PER_SPLIT
        hi = tl.minimum(lo + BLOCKS_PER_SPLIT, tl.cdiv(ctx, BLOCK_SIZE))
        if USE_WINDOW:
            lo = tl.maximum(lo, tl.maximum(ctx - window, 0) // BLOCK_SIZE)
        for blk in range(lo, hi):
            phys = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
            kv_off = (phys * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh
                      + offs_d[None, :])
            pos = blk * BLOCK_SIZE + offs_t
            valid = pos < ctx
            if USE_WINDOW:
                valid = valid & (pos > ctx - 1 - window)
            m_i, l_i, acc = attend_block(q, k_ptr, v_ptr, kv_off, d_mask, valid[None, :],
                                         m_i, l_i, acc, qk_scale, UPCAST, DOT_PRECISION)
    else:  # several blocks per step: a gather of TOKENS_PER_ITER rows, one table entry each
        offs_n = tl.arange(0, TOKENS_PER_ITER)
        lo_tok = split * (BLOCKS_PER_SPLIT * BLOCK_SIZE)
        hi_tok = tl.minimum(lo_tok + BLOCKS_PER_SPLIT * BLOCK_SIZE, ctx)
        if USE_WINDOW:
            first = tl.maximum(ctx - window, 0)
            lo_tok = tl.maximum(lo_tok, first - first % TOKENS_PER_ITER)
        for start in range(lo_tok, hi_tok, TOKENS_PER_ITER):
            pos = start + offs_n
            in_ctx = pos < hi_tok
            phys = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=in_ctx,
                           other=0).to(tl.int64)  # past the context: block 0, masked below
            kv_off = (phys[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_kt
                      + kvh * stride_kh + offs_d[None, :])
            valid = in_ctx
            if USE_WINDOW:
                valid = valid & (pos > ctx - 1 - window)
            m_i, l_i, acc = attend_block(q, k_ptr, v_ptr, kv_off, d_mask, valid[None, :],
                                         m_i, l_i, acc, qk_scale, UPCAST, DOT_PRECISION)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty row (padding) gives 0
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # scratch acc [B, H, S, BLOCK_D] and ml [B, H, S, 2], contiguous
        row = (b * (GQA * tl.num_programs(1)) + heads) * NUM_SPLITS + split  # [G]
        tl.store(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=out_mask)
        tl.store(ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _reduce_kernel(acc_ptr, ml_ptr, out_ptr, stride_ob, stride_oh, num_heads,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   SPLITS_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    row = (b * num_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l_s = tl.load(ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty (padding)
    w = tl.exp2(m - m_max)  # empty splits: exp2(-inf) = 0
    total = tl.sum(w * l_s, 0)
    acc = tl.load(acc_ptr + row[:, None] * BLOCK_D + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def num_splits_for(max_blocks_per_seq: int, block_size: int,
                   partition_tokens: int = PARTITION_TOKENS) -> tuple[int, int]:
    """(num_splits, blocks_per_split) for block tables `max_blocks_per_seq` wide.

    At most MAX_SPLITS: a graph captured for max_model_len-wide tables would otherwise
    launch mostly empty programs for short contexts.
    """
    blocks_per_split = max(1, partition_tokens // block_size,
                           -(-max_blocks_per_seq // MAX_SPLITS))
    return max(1, -(-max_blocks_per_seq // blocks_per_split)), blocks_per_split


def _tokens_per_iter(wanted: int, block_size: int, split_tokens: int) -> int:
    """The loop step in tokens: one block for 0, else `wanted` (a power of two of at least the
    block size) capped at the largest power of two within a split."""
    if wanted == 0:
        return block_size
    if wanted & (wanted - 1) or wanted < block_size:
        raise ValueError(f"tokens_per_iter={wanted} is invalid: allowed is 0 or a power of two "
                         f">= block_size {block_size}")
    return max(block_size, min(wanted, 1 << (split_tokens.bit_length() - 1)))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def plan_splits(width: int, block_size: int, rows: int, cfg: DecodeConfig,
                device: torch.device) -> tuple[int, int]:
    """(num_splits, blocks_per_split) for tables `width` blocks wide and `rows` = batch x kv
    heads programs per split: cfg's partition, halved while the grid is too small."""
    target = cfg.min_programs
    if target < 0:
        target = 2 * _sm_count(device.index or 0) if device.type == "cuda" else 0
    floor = max(block_size, cfg.tokens_per_iter)
    partition = max(cfg.partition_tokens, floor)
    while partition // 2 >= floor and rows * num_splits_for(width, block_size,
                                                            partition)[0] < target:
        partition //= 2
    return num_splits_for(width, block_size, partition)


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, context_lens: torch.Tensor) -> tuple[int, int, int]:
    checks.check_dim("q", q, 3)
    checks.check_dtype("q", q, checks.FLOAT_DTYPES)
    checks.check_last_contiguous("q", q)
    _, block_size, num_kv_heads, head_dim = checks.check_cache(k_cache, v_cache)
    checks.check_same_dtype("k_cache", k_cache, "q", q)
    b, h, d = q.shape
    if d != head_dim:
        raise ValueError(f"q head_dim {d} != cache head_dim {head_dim}")
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"cache block_size {block_size} is below the kernel's minimum "
                         f"{MIN_BLOCK_SIZE}: use the reference")
    checks.check_dim("block_tables", block_tables, 2)
    if block_tables.shape[0] != b:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {b} queries")
    checks.check_dtype("block_tables", block_tables, (torch.int32, torch.int64))
    checks.check_last_contiguous("block_tables", block_tables)
    checks.check_shape("context_lens", context_lens, (b,))
    checks.check_dtype("context_lens", context_lens, (torch.int32, torch.int64))
    checks.check_same_device(("q", q), ("k_cache", k_cache), ("block_tables", block_tables),
                             ("context_lens", context_lens))
    return checks.check_gqa(h, num_kv_heads), block_size, num_kv_heads


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None, *, partition_tokens: int | None = None,
                 config: DecodeConfig | None = None) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D], as `paged_decode_reference` (context_lens include the query).

    Rows with context length 0 (CUDA-graph padding) give zeros. `config` (default CONFIG)
    sets the launch; `partition_tokens`, if given, fixes the split size (no shrinking).
    """
    gqa, block_size, num_kv_heads = _check(q, k_cache, v_cache, block_tables, context_lens)
    cfg = config or CONFIG
    b, h, d = q.shape
    out = torch.empty_like(q)
    if b == 0:
        return out
    block_d = max(16, checks.next_pow2(d))
    if partition_tokens is None:
        num_splits, per_split = plan_splits(block_tables.shape[1], block_size,
                                            b * num_kv_heads, cfg, q.device)
    else:  # exactly as asked
        num_splits, per_split = num_splits_for(block_tables.shape[1], block_size,
                                               partition_tokens)
    per_iter = _tokens_per_iter(cfg.tokens_per_iter, block_size, per_split * block_size)
    launch = {k: v for k, v in (("num_warps", cfg.num_warps), ("num_stages", cfg.num_stages))
              if v is not None}
    if num_splits > 1:
        acc = torch.empty(b, h, num_splits, block_d, dtype=torch.float32, device=q.device)
        ml = torch.empty(b, h, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        acc = ml = out  # unused
    upcast, precision = dot_config(q.dtype, q.device)
    _decode_kernel[(b, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, acc, ml,
        scale * _LOG2E, sliding_window or 0, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GQA=gqa, GQA_PAD=max(16, checks.next_pow2(gqa)), HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCKS_PER_SPLIT=per_split, NUM_SPLITS=num_splits,
        TOKENS_PER_ITER=per_iter, USE_WINDOW=sliding_window is not None, UPCAST=upcast,
        DOT_PRECISION=precision, **launch)
    if num_splits > 1:
        _reduce_kernel[(b, h)](acc, ml, out, out.stride(0), out.stride(1), h, HEAD_DIM=d,
                               BLOCK_D=block_d, NUM_SPLITS=num_splits,
                               SPLITS_PAD=checks.next_pow2(num_splits))
    return out
