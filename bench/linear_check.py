"""CPU linears side by side, one thread, on the tiny model's shapes. fp32: the packed C kernel
against the layouts the runtime used before it (wide weights column-major, the rest
row-major, through dispatch.linear: MKL or the unpacked C kernels). bf16: the engine's
kernels on bf16 pair panels (`dispatch.linear` of a weight packed as a bf16 model packs it:
fp32 activations against the widened weight below dispatch.BF16_ROWS rows, bf16
activations on AMX or VDPBF16PS from there) against oneDNN's prepacked bf16 linear through
torch (the peer: AVX-512 BF16 or AMX where the CPU has them), both returning bf16. Prints
the CPU's vector flags first: which kernels a machine can run decides the figures.

    python -m meshserve.bench.linear_check [--rows 1 4 8 16 22 32 45 64 512]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from meshserve.kernels import dispatch, native_cpu
from meshserve.parallel.planner.calibration import best_time

CPU = torch.device("cpu")

SHAPES = {"lm head": (32000, 512), "gate/up": (2816, 512), "qkv": (1536, 512),
          "o_proj": (512, 512), "down": (512, 1408)}
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
"""The /proc/cpuinfo flags that decide which CPU kernels can run."""


def cpu_flags() -> list[str]:
    """VECTOR_FLAGS this CPU has (empty where /proc/cpuinfo cannot be read)."""
    try:
        text = open("/proc/cpuinfo").read()  # noqa: SIM115 - read once
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    have = set(line.split(":", 1)[-1].split())
    return [f for f in VECTOR_FLAGS if f in have]


def prepacked_bf16(weight: torch.Tensor, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """oneDNN's prepacked bf16 linear for `weight` at `rows` rows, where torch has it."""
    mkldnn = torch.ops.mkldnn
    if not (hasattr(mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()):
        return None
    w = weight.bfloat16()
    packed = mkldnn._reorder_linear_weight(w, rows)
    return lambda x: mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 22, 32, 45, 64, 512])
    args = p.parse_args()
    torch.set_num_threads(1)
    if native_cpu.library() is None:
        raise SystemExit("the C kernels did not build: nothing to compare")
    print("cpu flags:", " ".join(cpu_flags()) or "unknown")
    print(f"{'weight':8s} {'N x K':>11s} {'rows':>5s} {'before ms':>10s} {'packed ms':>10s} "
          f"{'ratio':>6s} {'GFLOP/s':>8s} {'bf16 ms':>8s} {'oneDNN ms':>10s} {'ratio':>6s}")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k)
        before = weight.t().contiguous().t() if n >= 2 * k else weight
        packed = torch.nn.Parameter(weight.clone(), requires_grad=False)
        dispatch.pack_weight(packed)
        pairs = torch.nn.Parameter(weight.clone(), requires_grad=False)
        dispatch.pack_weight(pairs, torch.bfloat16, bf16_batches=True)
        for m in args.rows:
            x = torch.randn(m, k)
            x16 = x.bfloat16()
            a = 1e3 * best_time(lambda x=x, w=before: dispatch.linear(x, w), 10, CPU)
            b = 1e3 * best_time(lambda x=x, w=packed: dispatch.linear(x, w), 10, CPU)
            c = 1e3 * best_time(lambda x=x16, w=pairs: dispatch.linear(
                x, w, out_dtype=torch.bfloat16), 10, CPU)
            pre = prepacked_bf16(weight, m)
            d = 1e3 * best_time(lambda x=x16, f=pre: f(x), 10, CPU) if pre else float("nan")
            print(f"{name:8s} {n:>5d} x {k:<4d} {m:5d} {a:10.2f} {b:10.2f} {a / b:6.2f} "
                  f"{2 * m * n * k / b / 1e6:8.1f} {c:8.3f} {d:10.3f} {d / c:6.2f}")


if __name__ == "__main__":
    main()
