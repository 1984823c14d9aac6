"""`python -m meshserve.bench.linear_check`: the CPU's flags, then every shape, both fp32
layouts and bf16 (ours against oneDNN's), one line each."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshserve.bench.linear_check import SHAPES
from meshserve.kernels import native_cpu


@pytest.mark.skipif(native_cpu.library() is None, reason="needs the C kernels")
def test_it_prints_both_layouts_for_every_shape() -> None:
    out = subprocess.run([sys.executable, "-m", "meshserve.bench.linear_check", "--rows", "3"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    flags, _header, *lines = out.stdout.splitlines()
    assert flags.startswith("cpu flags: ")
    rows = [line.split()[-8:] for line in lines]  # rows, the fp32 figures, the bf16 ones
    assert len(rows) == len(SHAPES)
    for row in rows:
        before, packed, ratio = map(float, row[1:4])
        assert before > 0 and packed > 0 and float(row[5]) > 0  # (bf16: ours)
        # Each figure is printed to 0.01: the ratio lies within what the rounding allows.
        low, high = (before - 0.005) / (packed + 0.005), (before + 0.005) / max(packed - 0.005,
                                                                               1e-9)
        assert low - 0.005 <= ratio <= high + 0.005, (before, packed, ratio)
