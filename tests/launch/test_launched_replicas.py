"""Data-parallel replicas under a launcher: `torchrun --nproc-per-node 2` and `mpirun -np 2`
with parallel.dp=2, `mpirun -np 4` with dp=2 x tp=2; prefill and decode replicas, one
rank each or one side of tp=2 or pp=2; rank 0 is the front and its router, each
replica's driver serves it; the tokens of one process, every rank exits 0."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
GENERATE = ["-m", "meshserve.launch.cli", "generate", "generate.max_tokens=8"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")
MPI = pytest.mark.skipif(
    shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs Open MPI's mpirun and mpi4py (./install.sh --dev installs both)")


def test_torchrun_with_two_replicas_matches_one_process(text3: Path, one_rank_output: list[str],
                                                        printed) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         *GENERATE, f"model.path='{text3}'", "parallel.dp=2", "parallel.timeout_s=60"],
        capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "2 ranks ready (dp=2, tp=1, pp=1)" in out.stderr
    assert "2 data-parallel replicas ready (launched; parallel.router=cache_aware)" in out.stderr
    assert printed(out.stdout) == one_rank_output  # only rank 0, the front, prints


@MPI
@pytest.mark.parametrize("layout", [["-np", "2", "parallel.dp=2"],
                                    ["-np", "4", "parallel.dp=2", "parallel.tp=2"]],
                         ids=["dp2", "dp2-tp2"])
def test_mpirun_replicas_match_one_process(text3: Path, one_rank_output: list[str], printed,
                                           layout: list[str]) -> None:
    np_, degrees = layout[:2], layout[2:]
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", *np_, "-x", "OMP_NUM_THREADS=1",
         sys.executable, *GENERATE, f"model.path='{text3}'", *degrees],
        capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    tp = 2 if "parallel.tp=2" in degrees else 1
    assert f"{np_[1]} ranks ready (dp=2, tp={tp}, pp=1)" in out.stderr
    assert "2 data-parallel replicas ready (launched" in out.stderr
    assert printed(out.stdout) == one_rank_output


DISAGG = ["disagg=manual", "disagg.min_prefill_tokens=0", "engine.block_size=4"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-x", "OMP_NUM_THREADS=1"]


@pytest.mark.parametrize(("launcher", "phases", "layout"), [
    ([*TORCHRUN, "--nproc-per-node=2"], [], "prefill tp=1 pp=1, decode tp=1 pp=1"),
    pytest.param([*MPIRUN, "-np", "2", sys.executable], [],
                 "prefill tp=1 pp=1, decode tp=1 pp=1", marks=MPI),
    ([*TORCHRUN, "--nproc-per-node=3"], ["disagg.prefill.tp=2"],
     "prefill tp=2 pp=1, decode tp=1 pp=1"),
    pytest.param([*MPIRUN, "-np", "3", sys.executable], ["disagg.decode.tp=2"],
                 "prefill tp=1 pp=1, decode tp=2 pp=1", marks=MPI),
    ([*TORCHRUN, "--nproc-per-node=3"], ["disagg.decode.pp=2", "disagg.connector=torch"],
     "prefill tp=1 pp=1, decode tp=1 pp=2"),
], ids=["torchrun", "mpirun", "torchrun-prefill-tp2", "mpirun-decode-tp2",
        "torchrun-decode-pp2"])
def test_launched_prefill_and_decode_replicas_match_one_process(
        text3: Path, one_rank_output: list[str], printed, launcher: list[str],
        phases: list[str], layout: str) -> None:
    """A replica of several ranks forms a world of its own out of the launched one."""
    out = subprocess.run([*launcher, *GENERATE, f"model.path='{text3}'", *DISAGG, *phases],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"1 prefill + 1 decode replicas ready ({layout}; launched;" in out.stderr, \
        out.stderr[-3000:]
    assert "KV of 3 requests moved from prefill to decode" in out.stderr, out.stderr[-3000:]
    assert printed(out.stdout) == one_rank_output
