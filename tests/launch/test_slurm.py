"""The sbatch templates on a real Slurm: 2 emulated nodes x 2 CPU ranks (gloo) on localhost.

The multi-node template puts TP inside each node and PP across them; its greedy output
must equal one process's. A bad override must fail the job with the error in its log.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.local_slurm import LocalSlurm, missing_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))]

REPO = Path(__file__).resolve().parents[2]
CPU_JOB = ["--gpus-per-node=0", "--cpus-per-task=1"]
"""The templates ask for GPUs and 8 CPUs per rank; the emulated nodes have 2 CPUs, no GPU."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), num_nodes=2, cpus=2)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
    assert not any(_alive(p) for p in cluster.pids()), "a Slurm daemon outlived the tests"


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def job_env(logs: Path, launch: str = "srun") -> dict[str, str]:
    return {"MESHSERVE_HOME": str(REPO), "MESHSERVE_PYTHON": sys.executable,
            "MESHSERVE_LOG_DIR": str(logs), "MESHSERVE_LAUNCH": launch, "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(("launch", "layout", "ready"), [
    # parallel=auto: the planner's replicas of its layout (for this tiny model, one rank
    # each), over both nodes
    ("srun", [], "4 ranks ready (dp=4, tp=1, pp=1)"),
    ("torchrun", [], "4 ranks ready (dp=4, tp=1, pp=1)"),
    ("srun", ["parallel.tp=2", "parallel.pp=2"], "4 ranks ready (tp=2, pp=2)"),
], ids=["srun-auto", "torchrun-auto", "srun-tp2-pp2"])
def test_multinode_template_matches_one_process(slurm: LocalSlurm, text3: Path,
                                                one_rank_output: list[str], printed,
                                                tmp_path: Path, launch: str,
                                                layout: list[str], ready: str) -> None:
    logs = tmp_path / "logs"
    job = slurm.sbatch([*CPU_JOB, "--nodes=2", "--ntasks-per-node=2",
                        f"--output={tmp_path}/job.out", str(REPO / "slurm/multinode.sbatch"),
                        "generate", f"model.path='{text3}'", "generate.max_tokens=8",
                        *layout],
                       env=job_env(logs, launch))
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert job.returncode == 0, job.stderr + out
    # Only rank 0 prints. Under torchrun the c10d rendezvous, not Slurm, decides which
    # node's agent hosts rank 0, so read every node's log.
    pattern = "rank0" if launch == "srun" else "node*"
    assert printed("".join(f.read_text() for f in sorted(logs.glob(f"{pattern}.out")))) == \
        one_rank_output
    err = "".join(f.read_text() for f in sorted(logs.glob(f"{pattern}.err")))
    assert ready in err
    if launch == "srun":  # every rank logs to its own files
        assert sorted(p.name for p in logs.glob("rank*.err")) == [
            f"rank{r}.err" for r in range(4)]


def test_bad_override_fails_the_job_with_the_error_logged(slurm: LocalSlurm, text3: Path,
                                                          tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    job = slurm.sbatch([*CPU_JOB, "--nodes=1", "--ntasks-per-node=2",
                        f"--output={tmp_path}/job.out", str(REPO / "slurm/serve.sbatch"),
                        "generate", f"model.path='{text3}'", "engine.max_num_seqs=-3"],
                       env=job_env(logs))
    assert job.returncode != 0
    log = (tmp_path / "job.out").read_text()
    assert "failed (exit code" in log
    assert "engine.max_num_seqs=-3 is invalid" in log
    assert "engine.max_num_seqs=-3 is invalid" in (logs / "rank1.err").read_text()
