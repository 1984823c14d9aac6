"""Small-batch linear layers in Triton: y [M, N] = x [M, K] @ w [N, K]^T (+ bias), M <= 16.

Decode reads every weight once per step for a handful of rows, so the layer is bound by
how fast the weight streams from memory. cuBLAS streams the large MLP weights near the
copy bandwidth but the smaller attention projections (qkv, o) well below it (on an H200
at batch 1: 72-76%). This kernel gives each program BLOCK_N weight rows and walks K in
BLOCK_K tiles (the rows of x padded to BLOCK_M for tl.dot), so many programs each keep
a deep pipeline of weight loads in flight.

`rule_for` decides, per batch and weight size, whether the dispatcher uses it and with
which launch: rules measured on a GPU architecture by the device check's sweep
(MEASURED_RULES), cuBLAS wherever none was measured.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from meshserve.kernels import checks
from meshserve.kernels.triton_import import dot_config, tl, triton

__all__ = ["GemvConfig", "GemvRule", "MEASURED_RULES", "RULES", "gemv", "gemv_reference",
           "rule_for"]

MAX_ROWS = 16
"""Largest M the kernel takes (one tl.dot tile of rows)."""


@dataclass(frozen=True)
class GemvConfig:
    """One launch of the kernel."""

    block_n: int = 16
    block_k: int = 512
    num_warps: int = 4
    num_stages: int = 4


@dataclass(frozen=True)
class GemvRule:
    """Use `config` for weights of at most `max_weight_bytes` and batches of at most
    `max_rows` rows; bigger ones go to cuBLAS."""

    max_rows: int
    max_weight_bytes: int
    config: GemvConfig
    dtypes: tuple[torch.dtype, ...] | None = None
    """Weight dtypes the rule was measured for (None: any). A launch tuned for 16-bit
    weights can need more shared memory than the chip has for float32 ones (an H200
    refused 288 KiB for the float32 o_proj rule)."""


_HALF = (torch.bfloat16, torch.float16)

MEASURED_RULES: dict[tuple[int, int], list[GemvRule]] = {
    # H200 (Hopper, 9.0), bf16 Llama-3-8B layers timed in CUDA graphs by the device check
    # (docs/benchmarks/records/h200-2026-11-30): o_proj 13.1 -> 10.9 us at 1 and 8 rows; qkv
    # 17.8 -> 15.1 us at 1 row (at 8 rows within 3% of cuBLAS); gate_up and down stay on
    # cuBLAS, which streams them at 95% of copy bandwidth in the model.
    (9, 0): [GemvRule(max_rows=8, max_weight_bytes=32 << 20,
                      config=GemvConfig(block_n=32, block_k=512, num_warps=4, num_stages=4),
                      dtypes=_HALF),
             GemvRule(max_rows=1, max_weight_bytes=64 << 20,
                      config=GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4),
                      dtypes=_HALF)],
}
"""Rules measured per GPU architecture (compute capability); others use cuBLAS only."""

RULES: list[GemvRule] | None = None
"""Checked in order. None: MEASURED_RULES for the weight's device; a list (the device check's
sweep, tests) replaces them everywhere; an empty list means cuBLAS for every shape."""


@functools.cache
def _arch_rules(device_index: int) -> list[GemvRule]:
    return MEASURED_RULES.get(torch.cuda.get_device_capability(device_index), [])


def rule_for(rows: int, weight: torch.Tensor) -> GemvConfig | None:
    """The config of the first rule that takes `rows` x `weight`, or None (cuBLAS)."""
    size = weight.numel() * weight.element_size()
    rules = RULES
    if rules is None:
        rules = _arch_rules(weight.device.index or 0) if weight.device.type == "cuda" else []
    for rule in rules:
        if (rows <= rule.max_rows and size <= rule.max_weight_bytes
                and (rule.dtypes is None or weight.dtype in rule.dtypes)):
            return rule.config
    return None


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + k[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemv_reference(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """torch's linear."""
    return torch.nn.functional.linear(x, weight, bias)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ weight [N, K]^T + bias [N] -> [M, N] in x's dtype."""
    cfg = config or GemvConfig()
    checks.check_dim("x", x, 2)
    checks.check_dim("weight", weight, 2)
    checks.check_dtype("x", x, checks.FLOAT_DTYPES)
    checks.check_same_dtype("weight", weight, "x", x)
    checks.check_last_contiguous("x", x)
    checks.check_last_contiguous("weight", weight)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"weight has {weight.shape[1]} columns for x's {k}")
    if m > MAX_ROWS:
        raise ValueError(f"x has {m} rows: allowed is at most {MAX_ROWS} (use cuBLAS)")
    if bias is not None:
        checks.check_shape("bias", bias, (n,))
        checks.check_same_dtype("bias", bias, "x", x)
    if cfg.block_n < 16 or cfg.block_k < 16:
        raise ValueError(f"GemvConfig block_n={cfg.block_n}, block_k={cfg.block_k}: allowed "
                         "are powers of two >= 16 (tl.dot tiles)")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    upcast, precision = dot_config(x.dtype, x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else out, out, m, n, k, x.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, BLOCK_M=16,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
