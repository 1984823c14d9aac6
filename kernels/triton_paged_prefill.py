"""Prefill and chunked-prefill attention in Triton over the paged KV cache.

One launch serves every prompt chunk of a step. Chunk n's queries are the tokens
[q_starts[n], q_starts[n] + q_lens[n]) of the flattened step at positions start_pos[n]..;
its keys are positions [0, start_pos[n] + q_lens[n]) read through block_tables[n]: a
previous chunk's, prefix-cache hits and (written just before) its own. Causal within
the chunk. Grid (chunk, query tile, head); the key loop stops at the tile's last query.
"""

from __future__ import annotations

import torch

from meshserve.kernels import checks
from meshserve.kernels.paged_attention import paged_prefill as paged_prefill_reference
from meshserve.kernels.triton_import import dot_config, tl, triton
from meshserve.kernels.triton_online_softmax import attend_block

__all__ = ["paged_prefill", "paged_prefill_reference"]

MIN_BLOCK_SIZE = 16
"""tl.dot needs tiles of at least 16 on the GPU; smaller cache blocks use the reference."""

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, q_starts_ptr, q_lens_ptr,
                    start_pos_ptr, qk_scale, window, stride_qt, stride_qh, stride_ot,
                    stride_oh, stride_kb, stride_kt, stride_kh, stride_tb,
                    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    USE_WINDOW: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    n = tl.program_id(0)
    tile = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GQA
    q_len = tl.load(q_lens_ptr + n).to(tl.int32)
    q_start = tl.load(q_starts_ptr + n).to(tl.int64)
    start = tl.load(start_pos_ptr + n).to(tl.int32)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, BLOCK_SIZE)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = q_start + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = start + offs_m

    # Keys up to the tile's last query; a tile past the chunk's end loops zero times.
    tile_end = tl.minimum(q_len, (tile + 1) * BLOCK_M)
    hi = tl.where(tile * BLOCK_M < q_len, tl.cdiv(start + tile_end, BLOCK_SIZE), 0)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(start + tile * BLOCK_M - window + 1, 0) // BLOCK_SIZE
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for blk in range(lo, hi):
        phys = tl.load(tables_ptr + n * stride_tb + blk).to(tl.int64)
        kv_off = (phys * stride_kb + offs_t[:, None] * stride_kt + kvh * stride_kh
                  + offs_d[None, :])
        k_pos = blk * BLOCK_SIZE + offs_t
        valid = k_pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            valid = valid & (k_pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_block(q, k_ptr, v_ptr, kv_off, d_mask, valid, m_i, l_i, acc,
                                     qk_scale, UPCAST, DOT_PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
           start_pos: torch.Tensor) -> tuple[int, int]:
    checks.check_dim("q", q, 3)
    checks.check_dtype("q", q, checks.FLOAT_DTYPES)
    checks.check_last_contiguous("q", q)
    _, block_size, num_kv_heads, head_dim = checks.check_cache(k_cache, v_cache)
    checks.check_same_dtype("k_cache", k_cache, "q", q)
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {head_dim}")
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"cache block_size {block_size} is below the kernel's minimum "
                         f"{MIN_BLOCK_SIZE}: use the reference")
    checks.check_dim("block_tables", block_tables, 2)
    checks.check_last_contiguous("block_tables", block_tables)
    n = block_tables.shape[0]
    for name, t in (("block_tables", block_tables), ("q_starts", q_starts),
                    ("q_lens", q_lens), ("start_pos", start_pos)):
        checks.check_dtype(name, t, (torch.int32, torch.int64))
        if name != "block_tables":
            checks.check_shape(name, t, (n,))
    checks.check_same_device(("q", q), ("k_cache", k_cache), ("block_tables", block_tables),
                             ("q_starts", q_starts), ("q_lens", q_lens),
                             ("start_pos", start_pos))
    return checks.check_gqa(q.shape[1], num_kv_heads), block_size


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, q_starts: torch.Tensor, q_lens: torch.Tensor,
                  start_pos: torch.Tensor, max_q_len: int, scale: float,
                  sliding_window: int | None = None, *, out: torch.Tensor | None = None,
                  block_m: int | None = None) -> torch.Tensor:
    """Attention of every chunk's queries (rows of q [T, H, D]) -> [T, H, D].

    Rows of q outside every chunk are left as they are in `out` (uninitialised if None).
    `max_q_len` bounds q_lens (a host int: the grid is sized from it).
    """
    gqa, block_size = _check(q, k_cache, v_cache, block_tables, q_starts, q_lens, start_pos)
    if out is None:
        out = torch.empty_like(q)
    checks.check_shape("out", out, tuple(q.shape))
    n, (_, h, d) = block_tables.shape[0], q.shape
    if n == 0 or max_q_len == 0:
        return out
    if block_m is None:
        block_m = 16 if q.device.type == "cpu" else 64
    block_d = max(16, checks.next_pow2(d))
    upcast, precision = dot_config(q.dtype, q.device)
    grid = (n, -(-max_q_len // block_m), h)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_starts, q_lens, start_pos,
        scale * _LOG2E, sliding_window or 0, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), GQA=gqa, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m,
        BLOCK_SIZE=block_size, USE_WINDOW=sliding_window is not None, UPCAST=upcast,
        DOT_PRECISION=precision)
    return out
