"""CPU linear layouts side by side, one thread: the packed C kernel against the layouts the
runtime used before it (wide weights column-major, the rest row-major, through
dispatch.linear: MKL or the unpacked C kernels), on the tiny model's shapes.

    python -m meshserve.bench.linear_check [--rows 1 4 8 16 22 32 45 64 512]
"""

from __future__ import annotations

import argparse

import torch

from meshserve.kernels import dispatch, native_cpu
from meshserve.parallel.planner.calibration import best_time

CPU = torch.device("cpu")

SHAPES = {"lm head": (32000, 512), "gate/up": (2816, 512), "qkv": (1536, 512),
          "o_proj": (512, 512), "down": (512, 1408)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 22, 32, 45, 64, 512])
    args = p.parse_args()
    torch.set_num_threads(1)
    if native_cpu.library() is None:
        raise SystemExit("the C kernels did not build: nothing to compare")
    print(f"{'weight':8s} {'N x K':>11s} {'rows':>5s} {'before ms':>10s} {'packed ms':>10s} "
          f"{'ratio':>6s} {'GFLOP/s':>8s}")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k)
        before = weight.t().contiguous().t() if n >= 2 * k else weight
        packed = torch.nn.Parameter(weight.clone(), requires_grad=False)
        dispatch.pack_weight(packed)
        for m in args.rows:
            x = torch.randn(m, k)
            a = 1e3 * best_time(lambda x=x, w=before: dispatch.linear(x, w), 10, CPU)
            b = 1e3 * best_time(lambda x=x, w=packed: dispatch.linear(x, w), 10, CPU)
            print(f"{name:8s} {n:>5d} x {k:<4d} {m:5d} {a:10.2f} {b:10.2f} {a / b:6.2f} "
                  f"{2 * m * n * k / b / 1e6:8.1f}")


if __name__ == "__main__":
    main()
