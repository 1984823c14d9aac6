"""Picks each kernel's implementation: Triton on CUDA, C (kernels/native_cpu.py) on the CPU.

MESHSERVE_KERNELS chooses: `auto` (the default: Triton for CUDA tensors when Triton is
installed; on the CPU the C kernels for fp32 decode attention, RMSNorm, rotary and the KV
write when a C compiler built them, else the PyTorch reference), `reference` (the PyTorch reference
everywhere), or `triton` (always, which on
a CPU means Triton's interpreter: TRITON_INTERPRET=1 must be set before Triton is first
imported; the kernel tests do this). Triton is imported only when a Triton path is
taken, so a CPU-only install never needs it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Protocol

import torch

from meshserve.kernels import activation as ref_activation
from meshserve.kernels import cpu_isa, native_cpu
from meshserve.kernels import paged_attention as ref_attention
from meshserve.kernels import rmsnorm as ref_rmsnorm
from meshserve.kernels import rotary as ref_rotary

ENV_VAR = "MESHSERVE_KERNELS"
MODES = ("auto", "reference", "triton")
MIN_ATTENTION_BLOCK_SIZE = 16
"""Smaller cache blocks take the reference attention (tl.dot's smallest tile)."""


@cache
def triton_installed() -> bool:
    """Whether Triton can be imported (looked up without importing it)."""
    return importlib.util.find_spec("triton") is not None


@cache
def kernel_mode() -> str:
    """The validated MESHSERVE_KERNELS value, read once per process (every layer of every
    step asks; `kernel_mode.cache_clear()` makes the next call read it again)."""
    mode = os.environ.get(ENV_VAR, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r} is invalid: allowed are {MODES}")
    return mode


def use_triton(device: torch.device) -> bool:
    """Whether kernels for tensors on `device` run in Triton."""
    return _use_triton(kernel_mode(), device.type)


@cache
def _use_triton(mode: str, device_type: str) -> bool:
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r} is invalid: allowed are {MODES}")
    if mode == "reference":
        return False
    if mode == "triton":
        if not triton_installed():
            raise ValueError(f"{ENV_VAR}=triton but triton is not installed: allowed are "
                             "auto and reference")
        return True
    return device_type == "cuda" and triton_installed()


def use_native(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the C kernels: fp32 on the CPU, auto mode, library built.
    (A plain loop: every linear and attention call of every layer asks, and a generator
    over the tensors cost more than the small kernels it dispatches.)"""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu:
            return False
    return _native_allowed(kernel_mode())


def native_panels(packed: torch.Tensor) -> bool:
    """Whether the C kernels read these packed panels: on the CPU, fp32 or bf16
    (model.cpu_weight_dtype), C kernels on."""
    return (packed.is_cpu and packed.dtype in native_cpu.WEIGHT_DTYPES
            and _native_allowed(kernel_mode()))


def native_packed(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether the C packed linear takes x (fp32 on the CPU) against these panels."""
    return native_panels(packed) and use_native(x)


def native_kv(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C attention reads these caches: on the CPU, contiguous, fp32 or bf16
    (engine.kv_cache_dtype), C kernels on."""
    return (k_cache.dtype is v_cache.dtype and k_cache.dtype in native_cpu.KV_DTYPES
            and k_cache.is_cpu and v_cache.is_cpu and k_cache.is_contiguous()
            and v_cache.is_contiguous() and _native_allowed(kernel_mode()))


def native_enabled() -> bool:
    """Whether the CPU's C kernels run: MESHSERVE_KERNELS=auto and the library built."""
    return _native_allowed(kernel_mode())


@cache
def _native_allowed(mode: str) -> bool:
    return mode == "auto" and native_cpu.library() is not None


@cache
def _module(name: str) -> ModuleType:
    return importlib.import_module(f"meshserve.kernels.{name}")


class ChunkLike(Protocol):
    """One prompt chunk among a step's flattened tokens (models.attention.PrefillChunk)."""

    token_start: int
    num_tokens: int
    start_pos: int
    block_table: torch.Tensor


class AttentionMetaLike(Protocol):
    """What the one-call CPU attention reads of a step (models.attention.AttentionMetadata):
    int64, contiguous."""

    slot_mapping: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor


@dataclass
class PrefillBatch:
    """A step's prompt chunks as the Triton prefill kernel reads them (built once per step)."""

    block_tables: torch.Tensor
    """[N, max_blocks] (long), padded with 0."""
    q_starts: torch.Tensor
    """[N] first token of each chunk among the step's tokens."""
    q_lens: torch.Tensor
    """[N] tokens per chunk."""
    start_pos: torch.Tensor
    """[N] position of each chunk's first token."""
    max_q_len: int
    """The longest chunk (sizes the grid)."""

    @classmethod
    def from_chunks(cls, chunks: Sequence[ChunkLike], device: torch.device) -> PrefillBatch:
        """Stack the chunks' block tables and offsets onto `device`."""
        tables = torch.nn.utils.rnn.pad_sequence([c.block_table for c in chunks],
                                                 batch_first=True)
        ints = torch.tensor([[c.token_start, c.num_tokens, c.start_pos] for c in chunks],
                            dtype=torch.long).t().contiguous()
        ints = ints.pin_memory().to(device, non_blocking=True) if device.type == "cuda" \
            else ints.to(device)
        return cls(tables.to(device), ints[0], ints[1], ints[2],
                   max(c.num_tokens for c in chunks))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at flat slots [T] of the caches."""
    if use_triton(k.device):
        _module("triton_write_kv").write_kv(k, v, k_cache, v_cache, slot_mapping)
    elif use_native(k, v) and native_kv(k_cache, v_cache):
        native_cpu.write_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        ref_attention.write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor:
    """One query per sequence: q [B, H, D] -> [B, H, D]."""
    if use_triton(q.device) and k_cache.shape[1] >= MIN_ATTENTION_BLOCK_SIZE:
        return _module("triton_paged_decode").paged_decode(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
    if q.shape[1] % k_cache.shape[2] == 0 and use_native(q) and native_kv(k_cache, v_cache):
        return native_cpu.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                       sliding_window)
    return ref_attention.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      sliding_window)


def attend_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetaLike, scale: float,
               sliding_window: int | None) -> torch.Tensor | None:
    """The CPU's one-call attention (native_cpu.attend_qkv): rotates q and k of qkv in place,
    stores K/V, returns the decodes' output [num_decode, H, D]. None where it doesn't apply
    (not fp32 on the CPU, reference mode, a layout it can't read): the caller then takes
    the step by step path."""
    if not (use_native(qkv, cos, sin) and native_kv(k_cache, v_cache) and qkv.is_contiguous()
            and cos.is_contiguous() and sin.is_contiguous()
            and num_heads % num_kv_heads == 0
            and all(t.dtype is torch.int64 and t.is_contiguous() for t in (
                meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens))):
        return None
    return native_cpu.attend_qkv(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache,
                                 meta.slot_mapping, meta.decode_block_tables,
                                 meta.decode_context_lens, scale, sliding_window)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, chunks: Sequence[ChunkLike], out: torch.Tensor,
            scale: float, sliding_window: int | None = None,
            batch: PrefillBatch | None = None) -> PrefillBatch | None:
    """Attention of every prompt chunk's rows of q [T, H, D] into `out`; K/V already written.

    On the CPU with the C kernels, one call for every chunk (native_cpu.prefill_attention
    over the cache as stored: fp32 products, or for a bf16 cache and output bf16 ones on AMX
    or VDPBF16PS; split over the C kernels' threads), else torch per chunk.
    Returns the PrefillBatch the Triton or C path built (pass it back for the step's next
    layers), or None on the reference path.
    """
    if use_triton(q.device) and k_cache.shape[1] >= MIN_ATTENTION_BLOCK_SIZE:
        batch = batch or PrefillBatch.from_chunks(chunks, q.device)
        _module("triton_paged_prefill").paged_prefill(
            q, k_cache, v_cache, batch.block_tables, batch.q_starts, batch.q_lens,
            batch.start_pos, batch.max_q_len, scale, sliding_window, out=out)
        return batch
    if q.is_cpu and q.dtype in native_cpu.KV_DTYPES and out.dtype in native_cpu.KV_DTYPES \
            and native_kv(k_cache, v_cache) and q.stride(2) == 1 \
            and q.stride(1) == q.shape[2] and out.is_contiguous() \
            and q.shape[1] % k_cache.shape[2] == 0:
        batch = batch or PrefillBatch.from_chunks(chunks, q.device)
        if native_cpu.prefill_attention(q, k_cache, v_cache, batch.block_tables,
                                        batch.q_starts, batch.q_lens, batch.start_pos, scale,
                                        sliding_window, out):
            return batch
    # An output in bf16 over a bf16 cache on the CPU: the queries are rounded too (the next
    # linear rounds this output anyway), and torch's flash attention runs 2.5-3x faster in
    # bf16 there (the keys and values are bf16 already)
    bf16 = q.is_cpu and out.dtype is torch.bfloat16 and k_cache.dtype is torch.bfloat16
    dtype = torch.bfloat16 if bf16 else q.dtype
    for c in chunks:
        sl = slice(c.token_start, c.token_start + c.num_tokens)
        if c.start_pos == 0:  # its own fresh K/V, as stored (every later read sees those)
            ks, vs = (t[sl].to(cache.dtype).to(dtype) for t, cache in ((k, k_cache),
                                                                       (v, v_cache)))
            out[sl] = ref_attention.causal_prefill(q[sl].to(dtype), ks, vs, scale,
                                                   sliding_window)
        else:
            out[sl] = ref_attention.paged_prefill(q[sl].to(dtype), k_cache, v_cache,
                                                  c.block_table, c.start_pos, scale,
                                                  sliding_window)
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight * x / rms(x) over the last dim of x [T, N], in `out_dtype` (default x's)."""
    if out_dtype is not None and out_dtype is not x.dtype:
        if _mixed_norm(x, x, weight, out_dtype):
            return native_cpu.add_rms_norm_mixed(x, None, weight, eps, out_dtype)[0]
        return rms_norm(x, weight, eps).to(out_dtype)
    if use_triton(x.device) and x.dim() == 2:
        return _module("triton_rmsnorm").rms_norm(x, weight, eps)
    if use_native(x, weight):
        return native_cpu.rms_norm(x, weight, eps)
    return ref_rmsnorm.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float, out_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) in `out_dtype` (default x's), x + residual in residual's
    dtype). x may be bf16 beside an fp32 residual (a oneDNN linear's output)."""
    if x.dtype is not residual.dtype or (out_dtype is not None and out_dtype is not x.dtype):
        want = out_dtype or x.dtype
        if _mixed_norm(x, residual, weight, want):
            return native_cpu.add_rms_norm_mixed(x, residual, weight, eps, want)
        out, summed = add_rms_norm(x.to(residual.dtype), residual, weight, eps)
        return out.to(want), summed
    if use_triton(x.device) and x.dim() == 2:
        return _module("triton_rmsnorm").add_rms_norm(x, residual, weight, eps)
    if use_native(x, residual, weight):
        return native_cpu.add_rms_norm(x, residual, weight, eps)
    return ref_rmsnorm.add_rms_norm(x, residual, weight, eps)


def _mixed_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                out_dtype: torch.dtype) -> bool:
    """Whether native_cpu.add_rms_norm_mixed takes these: on the CPU, x fp32 or bf16, the
    residual and weight fp32, the output fp32 or bf16, C kernels on."""
    return (x.is_cpu and x.dtype in native_cpu.KV_DTYPES and out_dtype in native_cpu.KV_DTYPES
            and residual.dtype is torch.float32 and weight.dtype is torch.float32
            and x.shape == residual.shape and native_enabled())


PACKED_COLUMNS = "packed_columns"
"""Attribute of a weight parameter packed by native_cpu.pack: its output width N (the
parameter is then [panels, K, PANEL]; see pack_weight)."""


def packed_columns(weight: torch.Tensor) -> int | None:
    """N of a packed weight (see pack_weight), None for a plain [N, K] one."""
    return getattr(weight, PACKED_COLUMNS, None)


def out_features(weight: torch.Tensor) -> int:
    """N of a linear weight, packed or [N, K]."""
    n = packed_columns(weight)
    return weight.shape[0] if n is None else n


def packing_applies(weight: torch.Tensor) -> bool:
    """Whether pack_weight can repack this weight: fp32 on the CPU with the C kernels."""
    return weight.dim() == 2 and use_native(weight)


def pack_weight(param: torch.nn.Parameter, dtype: torch.dtype = torch.float32,
                bf16_batches: bool = False) -> None:
    """Repack a linear weight [N, K] in place (its data becomes native_cpu.pack's panels, in
    `dtype`: float32, or bfloat16 pair panels for half the bytes, K even), for the C packed
    linears (against MKL: docs/benchmarks/2026-11-30-cpu-2core.md); they split their panels
    over torch's threads. `linear` takes it like any weight. With `bf16_batches` (a bf16
    model) bf16 panels run batches of BF16_ROWS rows or more with bf16 activations (AMX or
    VDPBF16PS, on the same panels: the weight is held once) where cpu_isa.bf16_batches;
    fewer rows, and every row without, keep fp32 activations against the widened weight."""
    n, k = param.shape
    if dtype is torch.bfloat16 and k % 2:
        dtype = torch.float32  # pair panels hold (k, k + 1) pairs
    param.data = native_cpu.pack(param.data, dtype)
    setattr(param, PACKED_COLUMNS, n)
    if dtype is torch.bfloat16 and bf16_batches and cpu_isa.bf16_batches():
        setattr(param, BF16_BATCHES, True)


BF16_BATCHES = "bf16_batches"
"""Attribute of bf16 pair panels (pack_weight) whose batches run with bf16 activations."""

BF16_ROWS = 4
"""Rows from which a bf16 model's linear rounds its activations to bf16 and runs AMX or
VDPBF16PS (native_cpu.linear_bf16), fp32 accumulation, rather than fp32 activations against
the widened weight: below it decode rows keep fp32 activations (the fused decoder's path);
from it the bf16 kernels are faster on the tiny model's shapes (`python -m
meshserve.bench.linear_check`)."""


def batches_in_bf16(weight: torch.Tensor) -> bool:
    """Whether `weight` (packed) runs batches of BF16_ROWS rows or more in bf16 (pack_weight)."""
    return getattr(weight, BF16_BATCHES, False)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of an embedding table [V, H]: F.embedding, or for a table packed as a tied
    LM head's panels (pack_weight) the C gather from them (torch's on the panels where the
    C kernels are off)."""
    if packed_columns(weight) is None:
        return torch.nn.functional.embedding(ids, weight)
    if native_panels(weight):
        return native_cpu.unpack_rows(weight, ids)
    if weight.dtype is torch.bfloat16:  # pair panels [N / 16, K / 2, 16 x 2]
        cols = native_cpu.PAIR_COLS
        lines = weight.view(weight.shape[0], weight.shape[1], cols, 2)
        return lines[ids // cols, :, ids % cols].flatten(-2).float()
    panel = weight.shape[2]
    return weight[ids // panel, :, ids % panel].float()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ weight^T + bias: on GPU the Triton small-batch kernel where a measured rule picks
    it (triton_gemv.RULES: decode-sized batches of smaller weights), on the CPU the C kernel
    for a packed weight (pack_weight; bf16 activations from BF16_ROWS rows of bf16 panels) or where
    native_linear_applies; else torch (cuBLAS, MKL). The result is in `out_dtype` for
    packed weights (default x's dtype; `linear_dtype` says which one costs no cast)."""
    n = packed_columns(weight)
    if n is not None:
        return _linear_packed(x, weight, n, bias, out_dtype or x.dtype)
    out = _linear_plain(x, weight, bias)
    return out if out_dtype is None or out.dtype is out_dtype else out.to(out_dtype)


def _linear_plain(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """linear() for a weight [N, K] as loaded."""
    if (use_triton(x.device) and x.dim() == 2 and x.stride(-1) == 1
            and weight.stride(-1) == 1):
        gemv = _module("triton_gemv")
        config = gemv.rule_for(x.shape[0], weight)
        if config is not None:
            return gemv.gemv(x, weight, bias, config)
    if bias is None and native_linear_applies(x, weight) and use_native(x, weight):
        return native_cpu.linear(x, weight)
    return torch.nn.functional.linear(x, weight, bias)


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor | None:
    """silu(gate) * up of x against a merged [gate; up] weight in one pass, where the bf16
    kernels take the batch (batches_in_bf16, BF16_ROWS rows or more; I a multiple of 16):
    the gate and up products never leave the kernel, each rounded once as the result.
    None otherwise: the caller runs `linear` then silu_and_mul."""
    n = packed_columns(weight)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = None if n is None else _bf16_batch(rows, weight, n, bias, out_dtype, swiglu=True)
    return None if out is None or n is None else out.view(*x.shape[:-1], n // 2)


def _bf16_batch(rows: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None,
                out_dtype: torch.dtype, swiglu: bool = False) -> torch.Tensor | None:
    """rows [M, K] through the bf16 kernels (native_cpu.linear_bf16), activations rounded to
    bf16, where they take the batch: batches_in_bf16, BF16_ROWS rows or more, C kernels on.
    None otherwise."""
    if not (batches_in_bf16(weight) and rows.shape[0] >= BF16_ROWS and rows.is_cpu
            and native_panels(weight) and out_dtype in native_cpu.WEIGHT_DTYPES):
        return None
    low = rows if rows.dtype is torch.bfloat16 else rows.to(torch.bfloat16)
    return native_cpu.linear_bf16(low if low.stride(1) == 1 else low.contiguous(), weight, n,
                                  None if bias is None else bias.float(), out_dtype,
                                  torch.get_num_threads(), swiglu=swiglu)


def linear_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype `linear(x, weight)` computes its result in: bf16 where the bf16 kernels
    take it (batches_in_bf16, BF16_ROWS rows or more), else x's. Asking linear for it saves
    a cast where the next kernel reads it as well (SwiGLU between gate/up and down)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if batches_in_bf16(weight) and rows >= BF16_ROWS and x.is_cpu:
        return torch.bfloat16
    return x.dtype


def _linear_packed(x: torch.Tensor, packed: torch.Tensor, n: int,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """linear() for a packed weight: the C kernels (bf16 activations for batches of bf16
    panels: batches_in_bf16), or (reference kernels, another dtype) torch on the weight
    unpacked, slow but the same product."""
    flat = x.dim() == 2
    rows = x if flat else x.reshape(-1, x.shape[-1])
    out = _bf16_batch(rows, packed, n, bias, out_dtype)
    if out is not None:
        return out if flat else out.view(*x.shape[:-1], n)
    if rows.dtype is torch.bfloat16 and rows.is_cpu:  # a bf16 activation for the C kernel
        rows = rows.float()
    if not native_packed(rows, packed):
        out = torch.nn.functional.linear(rows, native_cpu.unpack(packed, n).to(rows.dtype),
                                         bias)
        return (out if flat else out.view(*x.shape[:-1], n)).to(out_dtype)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = native_cpu.linear_packed(rows, packed, n, torch.get_num_threads())
    if not flat:
        out = out.view(*x.shape[:-1], n)
    return (out if bias is None else out + bias).to(out_dtype)


NATIVE_LINEAR_ROWS = (1, 24)
"""Rows [lo, hi] the C linear takes for a row-major weight (the runtime's one is a head tied
to the embedding): measured here 1.1-3x faster than MKL from 2 rows, which packs the weight
on every call at these sizes, and 1.03-1.28x at one row with the weight not in cache (a
4096 x 256 head 408 against 524 us; 32000 x 512 5.1 against 6.2 ms); from ~32 rows on
MKL's packing pays for itself. One kernel from 1 row up also gives a row the same logits
alone as beside others."""

NATIVE_LINEAR_T_ROWS = (2, 16)
"""The same for a column-major weight (the runtime's layout of wide weights)."""


def native_linear_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the C linear is the faster one for these shapes and layouts: one torch
    thread (the kernel is single-threaded), 2-D x with unit column stride, and a batch in
    the measured range for the weight's layout."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.dim() != 2 or torch.get_num_threads() != 1:
        return False
    m = x.shape[0]
    if weight.stride(1) == 1:
        lo, hi = NATIVE_LINEAR_ROWS
        return lo <= m <= hi
    lo, hi = NATIVE_LINEAR_T_ROWS
    return weight.stride(0) == 1 and lo <= m <= hi


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy tokens: logits [N, V] -> [N] int64, as logits.argmax(dim=-1) (the first
    largest; a NaN counts as the largest). On the CPU the C kernel, a single pass over each
    row (torch's argmax is several times slower there, on the driver's critical path)."""
    if (logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1
            and use_native(logits)):
        return native_cpu.argmax_rows(logits)
    return logits.argmax(dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    if use_triton(x.device) and x.dim() == 2:
        return _module("triton_silu_mul").silu_and_mul(x)
    if x.dim() == 2 and x.is_contiguous() and x.is_cpu and x.dtype in native_cpu.KV_DTYPES \
            and native_enabled():  # one pass, no chunk views
        return native_cpu.silu_mul(x)
    return ref_activation.silu_and_mul(x)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D // 2]. On the CPU's C path x itself is rotated
    and returned: pass a tensor nothing else reads (the model passes its fresh QKV)."""
    if use_triton(x.device):
        return _module("triton_rotary").apply_rotary(x, cos, sin)
    if x.stride(2) == 1 and x.stride(1) == x.shape[2] and use_native(x):
        return native_cpu.rotary_(x, cos, sin)
    return ref_rotary.apply_rotary(x, cos, sin)
