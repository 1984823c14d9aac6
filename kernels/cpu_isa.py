"""What vector instructions this CPU has, and which of them the CPU kernels use.

MESHSERVE_CPU_ISA picks the path: `auto` (the default: the widest this CPU runs), `avx512`
(AVX-512 F/BW/VL with BF16's VDPBF16PS, and AMX where the CPU has it, for batched bf16
linears) or `avx2` (AVX2 and FMA only: the C kernels' AVX2 code, fp32 activations against
widened bf16 weights). Forcing a path this CPU lacks is an error naming what is missing,
so a test can run both on a machine that has both and skip the one it lacks.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

ENV_VAR = "MESHSERVE_CPU_ISA"
ISAS = ("auto", "avx512", "avx2")
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
"""The /proc/cpuinfo flags that decide which CPU kernels can run."""
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), "avx2": ("avx2", "fma")}
"""The flags each forced path needs."""


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    return frozenset(line.split(":", 1)[-1].split())


def vector_flags() -> list[str]:
    """VECTOR_FLAGS this CPU has, in their order."""
    have = cpu_flags()
    return [f for f in VECTOR_FLAGS if f in have]


def supports(isa: str) -> bool:
    """Whether this CPU has every flag `isa` needs."""
    return all(f in cpu_flags() for f in NEEDS[isa])


@cache
def selected() -> str:
    """The path in use: `avx512`, `avx2`, or `none` (neither: x86 without AVX2, or another
    architecture). Read once per process (`selected.cache_clear()` reads it again)."""
    asked = os.environ.get(ENV_VAR, "auto")
    if asked not in ISAS:
        raise ValueError(f"{ENV_VAR}={asked!r} is invalid: allowed are {ISAS}")
    if asked != "auto":
        missing = [f for f in NEEDS[asked] if f not in cpu_flags()]
        if missing:
            raise ValueError(f"{ENV_VAR}={asked}: this CPU lacks {', '.join(missing)}; allowed "
                             f"here: {[i for i in ISAS if i == 'auto' or supports(i)]}")
        return asked
    return next((isa for isa in ("avx512", "avx2") if supports(isa)), "none")


def bf16_batches() -> bool:
    """Whether batched bf16 linears round their activations to bf16 and run the C kernels'
    AMX or VDPBF16PS loops (kernels/native/linear_bf16.c): the avx512 path, whose build has
    AVX512_BF16."""
    return selected() == "avx512"
