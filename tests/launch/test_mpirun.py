"""`mpirun -np 4 meshserve generate parallel.tp=2 parallel.pp=2`: ranks from MPI, the
rendezvous broadcast with mpi4py, the same greedy output as one process."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                       reason="needs Open MPI's mpirun and mpi4py (apt-get install openmpi-bin "
                              "libopenmpi-dev; pip install mpi4py; ./install.sh --dev does both)"),
]


def test_mpirun_tp2_pp2_matches_one_process(text3: Path, one_rank_output: list[str],
                                            printed) -> None:
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "4",
         "-x", "OMP_NUM_THREADS=1", sys.executable, "-m", "meshserve.launch.cli", "generate",
         "parallel.tp=2", "parallel.pp=2", f"model.path='{text3}'", "generate.max_tokens=8"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "4 ranks ready (tp=2, pp=2)" in out.stderr
    assert printed(out.stdout) == one_rank_output  # only rank 0 prints


def test_mpirun_with_a_layout_the_ranks_cannot_hold_fails_on_every_rank(text3: Path) -> None:
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "3",
         "-x", "OMP_NUM_THREADS=1", sys.executable, "-m", "meshserve.launch.cli", "generate",
         "parallel.tp=2", "parallel.pp=2", f"model.path='{text3}'"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    # Each rank checks the layout before it waits for any other, so none hangs. mpirun
    # stops the others once one exits with an error: on a busy machine a rank still
    # importing then goes without printing its own.
    said = out.stderr.count("= 4 ranks, but the world has 3")
    assert 1 <= said <= 3, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
