"""The C CPU kernels (kernels/native/*.c): built once per machine, called by ctypes.

On the CPU the PyTorch reference path pays for every small op it launches (microseconds
each) and for copying the paged KV cache into a padded tensor before attending over it.
These kernels read the cache blocks in place and fuse RMSNorm into one pass.

The library is compiled on first use with the system C compiler (`cc -O3`, for the path
cpu_isa.selected() names: -march=native, or AVX2 and FMA only where MESHSERVE_CPU_ISA=avx2)
into ~/.cache/meshserve/native (MESHSERVE_NATIVE_DIR overrides), keyed by the source, the
compiler, the path and this CPU's flags, so machines that share a home directory never load each
other's builds. Concurrent ranks each write a temporary file and rename it into place.
Without a compiler, or if the build fails, `library()` returns None once the reason has
been printed, and dispatch keeps the reference kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch

from meshserve.kernels import cpu_isa

NATIVE = Path(__file__).resolve().parent / "native"
SOURCES = tuple(NATIVE / f for f in ("cpu_kernels.c", "decoder.c", "pool.c",
                                     "prefill_attention.c", "linear_bf16.c"))
HEADERS = (NATIVE / "cpu_kernels.h", NATIVE / "vec_math.h")
FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-shared", "-std=c99", "-pthread"]
POOL_VAR = "MESHSERVE_CPU_POOL"
POOLS = {"openmp": ["-fopenmp"], "threads": []}
"""What splits a kernel's work over threads (kernels/native/pool.c): `openmp` (the default)
runs it on the OpenMP team torch's kernels use (its libgomp, loaded already), so the two do
not spin for the same cores; `threads`, worker threads of our own. A compiler without
OpenMP falls back to `threads`."""
ISA_FLAGS = {"avx512": ["-march=native"], "avx2": ["-march=haswell", "-mtune=native"],
             "none": ["-march=native"]}
"""Code generation per cpu_isa path: the avx2 build keeps to AVX2 and FMA (the C code's
AVX-512 parts are compiled out) even on a CPU with AVX-512, so both paths run here."""
DIR_VAR = "MESHSERVE_NATIVE_DIR"

_i64, _f32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def _cpu_id() -> str:
    """What -march=native depends on: the machine and its CPU flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return f"{platform.machine()} {platform.processor()} {flags}"


def _build(compiler: str, flags: list[str], out: Path) -> None:
    """Compile SOURCES with `flags` into `out` atomically (a temporary file renamed into
    place)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(compiler: str, isa: str, pool: str) -> ctypes.CDLL:
    """The library for this path and pool, built first if it is not in the cache."""
    flags = [*FLAGS, *ISA_FLAGS[isa], *POOLS[pool]]
    text = b"".join(f.read_bytes() for f in (*SOURCES, *HEADERS))
    key = hashlib.sha256(text + compiler.encode() + _cpu_id().encode() +
                         " ".join(flags).encode()).hexdigest()[:16]
    root = Path(os.environ.get(DIR_VAR) or Path.home() / ".cache" / "meshserve" / "native")
    path = root / f"cpu_kernels-{isa}-{pool}-{key}.so"
    if not path.exists():
        _build(compiler, flags, path)
    return ctypes.CDLL(str(path))


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them first if needed; None (said once) if they can't be."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        print("meshserve: no C compiler (cc) found; the CPU runs the PyTorch reference "
              "kernels", file=sys.stderr)
        return None
    isa = cpu_isa.selected()
    pool = os.environ.get(POOL_VAR) or "openmp"
    if pool not in POOLS:
        raise ValueError(f"{POOL_VAR}={pool!r} is invalid: allowed are {sorted(POOLS)}")
    pools = [pool] if pool == "threads" else [pool, "threads"]
    for i, pool in enumerate(pools):
        try:
            lib = _load(compiler, isa, pool)
            break
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", "") or str(e)).strip()[:500]
            then = ("builds with its own threads instead" if i + 1 < len(pools)
                    else "the CPU runs the PyTorch reference kernels")
            print(f"meshserve: the native CPU kernels did not build with {POOL_VAR}={pool} "
                  f"({detail}); {then}", file=sys.stderr)
    else:
        return None
    lib.ms_paged_decode_f32.restype = ctypes.c_int
    lib.ms_paged_decode_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
                                        _i64, _i64, _i64, _i64, _f32, _i64, _i64]
    lib.ms_rms_norm_f32.restype = None
    lib.ms_rms_norm_f32.argtypes = [_ptr, _ptr, _ptr, _i64, _i64, _f32]
    lib.ms_add_rms_norm_f32.restype = None
    lib.ms_add_rms_norm_f32.argtypes = [_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _f32]
    lib.ms_add_rms_norm_mixed_mt.restype = None
    lib.ms_add_rms_norm_mixed_mt.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _i64,
                                             _i64, _f32, _i64]
    lib.ms_rotary_inplace_f32.restype = None
    lib.ms_rotary_inplace_f32.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr]
    lib.ms_write_kv_f32.restype = None
    lib.ms_write_kv_f32.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64]
    lib.ms_attend_qkv_f32.restype = ctypes.c_int
    lib.ms_attend_qkv_f32.argtypes = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr,
                                      _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _f32, _i64,
                                      _ptr, _i64]
    lib.ms_linear_f32.restype = None
    lib.ms_linear_f32.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64]
    lib.ms_linear_t_f32.restype = None
    lib.ms_linear_t_f32.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64]
    lib.ms_pack_f32.restype = None
    lib.ms_pack_f32.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64]
    lib.ms_linear_packed_f32.restype = None
    lib.ms_linear_packed_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64]
    lib.ms_argmax_rows_f32.restype = None
    lib.ms_argmax_rows_f32.argtypes = [_ptr, _i64, _i64, _i64, _ptr]
    lib.ms_unpack_rows_f32.restype = None
    lib.ms_unpack_rows_f32.argtypes = [_ptr, _i64, _ptr, _i64, _ptr]
    lib.ms_linear_packed_mt.restype = ctypes.c_int
    lib.ms_linear_packed_mt.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                                        _i64]
    lib.ms_pack_pairs.restype = None
    lib.ms_pack_pairs.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64]
    lib.ms_unpack_rows_pairs.restype = None
    lib.ms_unpack_rows_pairs.argtypes = [_ptr, _i64, _ptr, _i64, _ptr]
    lib.ms_linear_pairs_f32.restype = None
    lib.ms_linear_pairs_f32.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64]
    lib.ms_linear_pairs_bf16_mt.restype = ctypes.c_int
    lib.ms_linear_pairs_bf16_mt.argtypes = [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64,
                                            _ptr, _i64, _i64, _i64, _i64]
    lib.ms_silu_mul_f32.restype = None
    lib.ms_silu_mul_f32.argtypes = [_ptr, _ptr, _i64, _i64]
    lib.ms_read_bytes.restype = ctypes.c_uint64
    lib.ms_read_bytes.argtypes = [_ptr, _i64]
    lib.ms_silu_mul_bf16_mt.restype = None
    lib.ms_silu_mul_bf16_mt.argtypes = [_ptr, _ptr, _i64, _i64, _i64]
    lib.ms_prefill_attention.restype = ctypes.c_int
    lib.ms_prefill_attention.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64,
                                         _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _f32, _i64,
                                         _ptr, _i64, _i64, _i64, _i64]
    lib.ms_decoder_forward_f32.restype = ctypes.c_int
    lib.ms_decoder_forward_f32.argtypes = [ctypes.POINTER(DecoderStruct), _i64, _ptr, _ptr,
                                           _ptr, _ptr, _i64, _ptr, _ptr]
    lib.ms_decoder_draft_greedy_f32.restype = ctypes.c_int
    lib.ms_decoder_draft_greedy_f32.argtypes = [ctypes.POINTER(DecoderStruct), _ptr, _i64,
                                                _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr,
                                                _i64, _ptr]
    return lib


class DecoderLayerStruct(ctypes.Structure):
    """One layer's weights and caches as decoder.c's MsDecoderLayer reads them (pointers;
    a bias may be None)."""

    _fields_ = [(name, _ptr) for name in (
        "input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "gate_up_bias",
        "down", "down_bias", "k_cache", "v_cache")]


class DecoderStruct(ctypes.Structure):
    """A decoder as decoder.c's MsDecoder reads it."""

    _fields_ = [
        *((name, _i64) for name in ("num_layers", "hidden", "heads", "kv_heads", "head_dim",
                                    "intermediate", "block_size", "window", "kv_bf16",
                                    "weights_bf16")),
        ("eps", _f32), ("scale", _f32), ("embed", _ptr), ("embed_packed", _i64),
        ("cos", _ptr), ("sin", _ptr), ("final_norm", _ptr),
        ("layers", ctypes.POINTER(DecoderLayerStruct)), ("threads", _i64)]


KV_DTYPES = (torch.float32, torch.bfloat16)
"""Cache dtypes the C attention reads and writes (queries and outputs are fp32)."""


def kv_bf16(cache: torch.Tensor) -> int:
    """The C kernels' flag for a cache's dtype: 1 for bf16, 0 for fp32."""
    assert cache.dtype in KV_DTYPES, f"the C kernels read fp32 or bf16 caches, not {cache.dtype}"
    return int(cache.dtype is torch.bfloat16)


def _loaded() -> ctypes.CDLL:
    """The library, for the kernel wrappers below (dispatch calls them only once built)."""
    lib = library()
    assert lib is not None, "a native_cpu kernel was called without the library"
    return lib


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                 sliding_window: int | None = None) -> torch.Tensor:
    """One query per sequence, q [B, H, D] -> [B, H, D], reading K/V blocks in place."""
    lib = _loaded()
    b, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty(b, h, d, dtype=q.dtype)
    if b == 0:
        return out
    rc = lib.ms_paged_decode_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), lens.data_ptr(), out.data_ptr(), b, h, k_cache.shape[2], d,
        k_cache.shape[1], scale, sliding_window or 0, kv_bf16(k_cache))
    if rc != 0:
        raise MemoryError(f"paged decode attention: no memory for {h} x "
                          f"{int(lens.max())} scores")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dimension."""
    lib = _loaded()
    x = x.contiguous()
    out = torch.empty_like(x)
    width = x.shape[-1]
    lib.ms_rms_norm_f32(x.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(),
                        x.numel() // width, width, eps)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    lib = _loaded()
    x, residual = x.contiguous(), residual.contiguous()
    out, summed = torch.empty_like(x), torch.empty_like(x)
    width = x.shape[-1]
    lib.ms_add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.contiguous().data_ptr(),
                            out.data_ptr(), summed.data_ptr(), x.numel() // width, width, eps)
    return out, summed


def add_rms_norm_mixed(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, out_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) in out_dtype, x + residual in fp32) for x fp32 or bf16 and
    out_dtype fp32 or bf16; without a residual, (rms_norm(x), x) for x fp32. Rows split
    over torch's threads (the C pool) where there are enough."""
    x = x.contiguous()
    width = x.shape[-1]
    out = torch.empty(x.shape, dtype=out_dtype)
    summed = x if residual is None else torch.empty(x.shape, dtype=torch.float32)
    _loaded().ms_add_rms_norm_mixed_mt(
        x.data_ptr(), int(x.dtype is torch.bfloat16),
        None if residual is None else residual.contiguous().data_ptr(),
        weight.contiguous().data_ptr(), out.data_ptr(), int(out_dtype is torch.bfloat16),
        summed.data_ptr(), x.numel() // width, width, eps, torch.get_num_threads())
    return out, summed


def _rows_packed(x: torch.Tensor) -> bool:
    """Whether x [T, H, D] has each token's H x D values contiguous (any token stride)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by cos/sin [T, D // 2] in place (x must be writable: the model
    passes a slice of its fresh QKV projection); returns x."""
    lib = _loaded()
    assert _rows_packed(x), f"rotary_: x strides {x.stride()} are not [T, H, D] row-packed"
    t, h, d = x.shape
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    lib.ms_rotary_inplace_f32(x.data_ptr(), x.stride(0), t, h, d, cos.data_ptr(),
                              sin.data_ptr())
    return x


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store k, v [T, Hkv, D] at flat slots [T] of the contiguous caches."""
    lib = _loaded()
    if not (_rows_packed(k) and _rows_packed(v)):
        k, v = k.contiguous(), v.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    lib.ms_write_kv_f32(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k.shape[0],
                        k.shape[1] * k.shape[2], k_cache.data_ptr(), v_cache.data_ptr(),
                        slots.data_ptr(), kv_bf16(k_cache))


def attend_qkv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor,
               sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               slot_mapping: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float,
               sliding_window: int | None) -> torch.Tensor:
    """One C call for a layer's attention as far as the decodes go: rotate q and k of
    qkv [T, H + 2 Hkv, D] in place, store every token's K/V at its slot, and attend the
    first len(context_lens) tokens (the decodes) -> [num_decode, H, D]. Every tensor must
    already be contiguous, fp32 (cos, sin), fp32 or bf16 (caches) or int64 (slots, tables, lengths): the
    caller checks (dispatch.attend_qkv). The decodes split over torch's thread count (the C
    pool), each row computed as alone."""
    lib = _loaded()
    num_decode, d = context_lens.shape[0], qkv.shape[2]
    out = torch.empty(num_decode, num_heads, d)
    rc = lib.ms_attend_qkv_f32(
        qkv.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, d, cos.data_ptr(),
        sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_bf16(k_cache),
        k_cache.shape[1],
        slot_mapping.data_ptr(), num_decode, block_tables.data_ptr(), block_tables.stride(0),
        context_lens.data_ptr(), scale, sliding_window or 0, out.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"paged decode attention: no memory for {num_heads} x "
                          f"{int(context_lens.max())} scores")
    return out


PREFILL_UNSUPPORTED = -2
"""ms_prefill_attention's answer where it has no vector path for the shape (the head size
not a multiple of the vector width, or neither AVX-512 nor AVX2 compiled in)."""


PREFILL_BEST = -1
PREFILL_VARIANTS = {"fp32": 0, "avx512_bf16": 1, "amx": 2}
"""ms_prefill_attention's inner loops: fp32 FMAs (AVX-512 or AVX2; any dtypes), or, for a
bf16 cache and bf16 output, VDPBF16PS or AMX tiles (q and P rounded to bf16)."""


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor,
                      positions: torch.Tensor, scale: float, sliding_window: int | None,
                      out: torch.Tensor, variant: int = PREFILL_BEST) -> bool:
    """Causal attention of every prompt chunk (kernels/native/prefill_attention.c): chunk i
    is q's tokens [starts[i], starts[i] + lens[i]) at positions positions[i] onwards,
    reading its sequence's keys through tables[i] (their K/V already stored). q [T, H, D]
    (fp32 or bf16, unit stride within a token), out [T, H, D] (fp32 or bf16, contiguous);
    int64 contiguous metadata. Split over torch's thread count (the C pool). `variant`
    (PREFILL_VARIANTS; tests pin each) defaults to the fastest this CPU has for these
    dtypes. False where the kernel has no path for these shapes, or not the variant asked
    (the caller keeps torch's)."""
    t, h, d = q.shape
    assert q.stride(2) == 1 and q.stride(1) == d and out.is_contiguous()
    assert q.dtype in KV_DTYPES and out.dtype in KV_DTYPES
    rc = _loaded().ms_prefill_attention(
        q.data_ptr(), kv_bf16(q), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
        kv_bf16(k_cache), k_cache.shape[1], k_cache.shape[2], d, h, tables.data_ptr(),
        tables.stride(0), starts.data_ptr(), lens.data_ptr(), positions.data_ptr(),
        starts.shape[0], scale, sliding_window or 0, out.data_ptr(), kv_bf16(out), h * d,
        torch.get_num_threads(), variant)
    if rc == PREFILL_UNSUPPORTED:
        return False
    if rc != 0:
        raise MemoryError(f"prefill attention: no memory for {int(lens.max())} queries' keys")
    return True


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight.T: [M, N], for a weight [N, K] stored row-major (stride (K, 1)) or
    column-major (stride (1, N)), and x with unit column stride."""
    lib = _loaded()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype)
    if m:
        if weight.stride(1) == 1:
            lib.ms_linear_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                              out.data_ptr(), n, m, k, n)
        else:
            lib.ms_linear_t_f32(x.data_ptr(), x.stride(0), weight.data_ptr(),
                                weight.stride(1), out.data_ptr(), n, m, k, n)
    return out


PANEL = 24
"""Output columns per panel of a packed fp32 weight (cpu_kernels.c: PANEL)."""
PAIR_COLS = 16
"""Output columns per pair panel of a packed bf16 weight (linear_bf16.c: COLS)."""


WEIGHT_DTYPES = (torch.float32, torch.bfloat16)
"""What packed panels may hold: fp32 panels, or bf16 pair panels."""


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float32 weight [N, K] (any strides) packed for the C linears. fp32: panels
    [ceil(N / PANEL), K, PANEL], panel p holding output columns p * PANEL onwards, one row of
    PANEL per k. bf16 (each value rounded to nearest even; K even): pair panels
    [ceil(N / 16), K / 2, 32], panel p holding columns 16 p onwards as K / 2 lines of 16
    (k, k + 1) pairs (kernels/native/linear_bf16.c). Zeros past N."""
    assert dtype in WEIGHT_DTYPES, f"panels hold fp32 or bf16, not {dtype}"
    n, k = weight.shape
    if dtype is torch.bfloat16:
        assert k % 2 == 0, f"bf16 pair panels need an even K, not {k}"
        out = torch.empty((n + PAIR_COLS - 1) // PAIR_COLS, k // 2, 2 * PAIR_COLS,
                          dtype=torch.bfloat16)
        _loaded().ms_pack_pairs(weight.data_ptr(), weight.stride(0), weight.stride(1),
                                out.data_ptr(), n, k)
        return out
    out = torch.empty((n + PANEL - 1) // PANEL, k, PANEL, dtype=torch.float32)
    _loaded().ms_pack_f32(weight.data_ptr(), weight.stride(0), weight.stride(1),
                          out.data_ptr(), n, k)
    return out


def packed_k(packed: torch.Tensor) -> int:
    """K of a packed weight: fp32 panels or bf16 pair panels."""
    return packed.shape[1] * (2 if packed.dtype is torch.bfloat16 else 1)


def unpack(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The weight [n, K] that `pack` made `packed` from (a new row-major tensor, in the
    panels' dtype)."""
    panels = packed.shape[0]
    if packed.dtype is torch.bfloat16:
        lines = packed.view(panels, -1, PAIR_COLS, 2).permute(0, 2, 1, 3)
        return lines.reshape(panels * PAIR_COLS, packed_k(packed))[:n].contiguous()
    return packed.permute(0, 2, 1).reshape(panels * PANEL, packed.shape[1])[:n].contiguous()


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` (int64, any shape, each in range) of the weight `packed` = pack(weight):
    an embedding lookup from a tied head's panels -> [*ids.shape, K]."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    k = packed_k(packed)
    out = torch.empty(flat.shape[0], k, dtype=torch.float32)
    gather = (_loaded().ms_unpack_rows_pairs if packed.dtype is torch.bfloat16
              else _loaded().ms_unpack_rows_f32)
    if flat.shape[0]:
        gather(packed.data_ptr(), k, flat.data_ptr(), flat.shape[0], out.data_ptr())
    return out.view(*ids.shape, k)


THREAD_MIN_FLOPS = 500_000
"""Below this much work (about 12 us on one core) a packed linear stays on one thread: the
pool's workers start a part within a microsecond while they spin, but a part costs its
start and its share of the weight's cache lines (decoder.c: MT_MIN_FLOPS)."""


def linear_threads(flops: int, threads: int) -> int:
    """Threads a packed linear of `flops` work splits over, of `threads` allowed: one per
    THREAD_MIN_FLOPS of work, at least one."""
    return 1 if threads <= 1 else min(threads, max(1, flops // THREAD_MIN_FLOPS))


def linear_packed(x: torch.Tensor, packed: torch.Tensor, n: int,
                  threads: int = 1) -> torch.Tensor:
    """x [M, K] (fp32, unit column stride) @ weight.T: [M, n] fp32, for `packed` =
    pack(weight) (fp32 panels, or bf16 pair panels widened in registers). With `threads` >
    1 and enough work, the panels are split into that many contiguous ranges over the C
    pool's persistent threads (pool.c); every output is computed exactly as on one
    thread."""
    m, k = x.shape
    assert x.stride(1) == 1 and packed_k(packed) == k and packed.is_contiguous(), (
        x.shape, x.stride(), packed.shape)
    out = torch.empty(m, n, dtype=torch.float32)
    if not m:
        return out
    lib = _loaded()
    threads = min(linear_threads(2 * m * n * k, threads), packed.shape[0])
    bf16 = packed.dtype is torch.bfloat16
    args = (x.data_ptr(), x.stride(0), packed.data_ptr(), out.data_ptr(), n, m, k, n)
    if threads > 1:
        lib.ms_linear_packed_mt(*args, int(bf16), threads)
    elif bf16:
        lib.ms_linear_pairs_f32(*args)
    else:
        lib.ms_linear_packed_f32(*args)
    return out


BF16_BEST = 0
BF16_VARIANTS = {"avx512_bf16": 1, "amx": 2}
"""ms_linear_pairs_bf16's kernels for bf16 activations: VDPBF16PS, or AMX tiles (K a
multiple of 32); BF16_BEST is the fastest this CPU has."""


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None,
                out_dtype: torch.dtype, threads: int = 1, variant: int = BF16_BEST,
                swiglu: bool = False) -> torch.Tensor | None:
    """x [M, K] (bf16, unit column stride) @ weight.T + bias (fp32) for bf16 pair panels
    `packed` of n columns, summed in fp32 and rounded once into out_dtype (bf16 or fp32);
    AMX or VDPBF16PS (kernels/native/linear_bf16.c), the columns split over `threads` parts
    (the pool). With `swiglu` the weight is a merged [gate; up] of n = 2I rows (I a multiple
    of 16) and the result silu(gate) * up [M, I], in the same pass. None where this CPU or
    build has neither kernel (or not `variant`)."""
    m, k = x.shape
    assert x.dtype is torch.bfloat16 and x.stride(1) == 1 and packed_k(packed) == k, (
        x.dtype, x.stride(), packed.shape)
    assert out_dtype in WEIGHT_DTYPES and (bias is None or bias.dtype is torch.float32)
    cols, up = (n // 2, n // 2 // PAIR_COLS) if swiglu else (n, 0)
    if swiglu and (n % (2 * PAIR_COLS) or bias is not None and bias.shape[0] != n):
        return None
    out = torch.empty(m, cols, dtype=out_dtype)
    if not m:
        return out
    threads = min(linear_threads(2 * m * n * k, threads), packed.shape[0])
    rc = _loaded().ms_linear_pairs_bf16_mt(
        x.data_ptr(), x.stride(0), packed.data_ptr(), k, cols, out.data_ptr(), cols,
        int(out_dtype is torch.bfloat16), 0 if bias is None else bias.contiguous().data_ptr(),
        m, variant, up, threads)
    if rc == PREFILL_UNSUPPORTED:
        return None
    if rc != 0:
        raise MemoryError(f"bf16 linear: no memory to pad {m % 16} rows of K={k}")
    return out


def read_bytes(buf: torch.Tensor) -> int:
    """Read every byte of `buf` (contiguous, 64-byte aligned, a multiple of 256 bytes) once
    in C, with this build's widest loads; returns the XOR of its 64-bit words."""
    n = buf.numel() * buf.element_size()
    assert buf.is_contiguous() and buf.data_ptr() % 64 == 0 and n % 256 == 0, (n, buf.data_ptr())
    return int(_loaded().ms_read_bytes(buf.data_ptr(), n))


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up], contiguous, fp32 or bf16 -> silu(gate) * up [T, I] in x's
    dtype (computed in fp32)."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype)
    if rows and x.dtype is torch.bfloat16:  # rows split over torch's threads (the C pool)
        _loaded().ms_silu_mul_bf16_mt(x.data_ptr(), out.data_ptr(), rows, width,
                                      torch.get_num_threads())
    elif rows:
        _loaded().ms_silu_mul_f32(x.data_ptr(), out.data_ptr(), rows, width)
    return out


def decoder_forward(decoder: DecoderStruct, input_ids: torch.Tensor, positions: torch.Tensor,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor) -> torch.Tensor:
    """The final hidden states [T, hidden] of T decode rows (decoder.c): every tensor
    int64 and contiguous, one block-table row and context length per row."""
    t = input_ids.shape[0]
    out = torch.empty(t, decoder.hidden, dtype=torch.float32)
    rc = _loaded().ms_decoder_forward_f32(
        ctypes.byref(decoder), t, input_ids.data_ptr(), positions.data_ptr(),
        slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        context_lens.data_ptr(), out.data_ptr())
    if rc != 0:
        raise MemoryError(f"fused decoder forward: no memory for {t} rows of "
                          f"{int(context_lens.max())} tokens")
    return out


def decoder_draft_greedy(decoder: DecoderStruct, head: torch.Tensor, vocab: int,
                         drafted: torch.Tensor, start: torch.Tensor, block_tables: torch.Tensor,
                         wanted: torch.Tensor, feed_tokens: torch.Tensor | None = None,
                         feed_counts: torch.Tensor | None = None) -> None:
    """Greedy drafts of B rows into drafted [B, k], the head `head` packed (decoder.c:
    ms_decoder_draft_greedy_f32): with feed_tokens / feed_counts each row first feeds its
    tokens from position start[r] and drafts from its last; without, drafted[:, 0] is
    given and start[r] is the last known token's position. wanted [B]: each row's drafts
    in all. Every tensor int64 and contiguous but the head."""
    b, k = drafted.shape
    rc = _loaded().ms_decoder_draft_greedy_f32(
        ctypes.byref(decoder), head.data_ptr(), vocab, b,
        None if feed_tokens is None else feed_tokens.data_ptr(),
        None if feed_counts is None else feed_counts.data_ptr(), start.data_ptr(),
        block_tables.data_ptr(), block_tables.stride(0), wanted.data_ptr(), k,
        drafted.data_ptr())
    if rc != 0:
        raise MemoryError(f"fused greedy drafts: no memory for {b} rows")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] (unit column stride, V >= 1) -> [N] int64: each row's torch.argmax (the first
    largest value; a NaN counts as the largest)."""
    rows, cols = x.shape
    assert cols >= 1 and x.stride(1) == 1, (x.shape, x.stride())
    out = torch.empty(rows, dtype=torch.long)
    if rows:
        _loaded().ms_argmax_rows_f32(x.data_ptr(), x.stride(0), rows, cols, out.data_ptr())
    return out
