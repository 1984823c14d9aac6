"""The sbatch templates on a real Slurm: 2 emulated nodes x 2 CPU ranks (gloo) on localhost.

The multi-node template puts TP inside each node and PP across them; its greedy output
must equal one process's. A bad override must fail the job with the error in its log.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
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


def test_serve_template_runs_a_replica_per_node_behind_the_first(slurm: LocalSlurm, text3: Path,
                                                                 tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    sub = subprocess.run(
        ["sbatch", "--parsable", *CPU_JOB, "--nodes=2", "--ntasks-per-node=1",
         f"--output={tmp_path}/job.out", str(REPO / "slurm/serve.sbatch"), "serve",
         f"model.path='{text3}'", "parallel.dp=2", "parallel.router=round_robin",
         "serve.port=0"],
        capture_output=True, text=True, env={**slurm.env, **job_env(logs)}, check=True)
    job = sub.stdout.strip().split(";")[0]
    try:
        url = _wait_listening(logs / "rank0.out", tmp_path / "job.out", 180)
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert [(r["replica"], r["status"]) for r in health["replicas"]] == [(0, "up"),
                                                                            (1, "up")]
        body = {"prompt": [1, 2, 3, 4], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        texts = [httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
                 ["choices"][0]["text"] for _ in range(4)]
        assert len(set(texts)) == 1  # greedy: both replicas give the same text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        for replica in (0, 1):  # round-robin: each node's replica served two of them
            assert (f'meshserve_generation_tokens_total{{replica="{replica}",'
                    f'role="colocated"}} 12.0') in metrics, metrics
        # Only the first node's rank hosts the front end; the other runs its replica.
        assert "listening on" not in (logs / "rank1.out").read_text()
    finally:
        subprocess.run(["scancel", job], env=slurm.env, check=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and subprocess.run(
                ["squeue", "-h", "-j", job], capture_output=True, text=True,
                env=slurm.env).stdout.strip():
            time.sleep(0.5)


def _wait_listening(rank0_out: Path, job_out: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = rank0_out.read_text() if rank0_out.exists() else ""
        m = re.search(r"listening on (http://[\d.]+:\d+)", text)
        if m:
            return m.group(1)
        time.sleep(0.5)
    raise TimeoutError(f"no 'listening on' in {rank0_out} within {timeout_s} s:\n"
                       + (job_out.read_text() if job_out.exists() else ""))


@pytest.mark.parametrize(("per_node", "phases", "layout"), [
    (1, ["disagg.connector=torch"], "prefill tp=1 pp=1, decode tp=1 pp=1; launched; "
                                    "disagg.connector=torch"),
    (2, ["disagg.prefill.tp=2", "disagg.decode.tp=2", "disagg.connector=nixl"],
     "prefill tp=2 pp=1, decode tp=2 pp=1; launched; disagg.connector=nixl"),
], ids=["one-rank-torch", "tp2-nixl"])
def test_prefill_on_one_node_decode_on_the_other(slurm: LocalSlurm, text3: Path,
                                                 one_rank_output: list[str], printed,
                                                 tmp_path: Path, per_node: int,
                                                 phases: list[str], layout: str) -> None:
    logs = tmp_path / "logs"
    job = slurm.sbatch([*CPU_JOB, "--nodes=2", f"--ntasks-per-node={per_node}",
                        f"--output={tmp_path}/job.out", str(REPO / "slurm/multinode.sbatch"),
                        "generate", f"model.path='{text3}'", "generate.max_tokens=8",
                        "disagg=manual", "disagg.min_prefill_tokens=0", "engine.block_size=4",
                        *phases],
                       env=job_env(logs))
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert job.returncode == 0, job.stderr + out
    assert printed((logs / "rank0.out").read_text()) == one_rank_output
    err = (logs / "rank0.err").read_text()
    assert f"1 prefill + 1 decode replicas ready ({layout})" in err, err
    moved = re.search(r"KV of (\d+) requests moved from prefill to decode", err)
    assert moved is not None and int(moved.group(1)) >= 1, err
