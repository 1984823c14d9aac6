"""`calibrate`'s paged-decode timing (8 sequences of 512 tokens) at eight (KV heads, head
dim) shapes: ns per cached token and layer, and the bytes/s that makes."""

from __future__ import annotations

import torch

from meshserve.parallel.planner.calibration import kv_row_seconds

SHAPES = ((4, 32), (8, 32), (2, 64), (4, 64), (8, 64), (2, 128), (4, 128), (8, 128))


def main() -> None:
    torch.set_num_threads(1)
    for heads, dim in SHAPES:
        t = kv_row_seconds(torch.device("cpu"), 5, heads, dim)
        row = 2 * heads * dim * 4
        print((heads, dim), row, f"ns/row {t * 1e9:.1f}  GB/s {row / t / 1e9:.1f}")


if __name__ == "__main__":
    main()
