"""A real Slurm (Debian's slurm-wlm) on localhost, for the tests and for trying the
sbatch templates without a cluster: one slurmctld and one slurmd per emulated node,
started as root without munge and stopped by PID.

Each node is a slurmd with its own name, port, spool and TmpFS; all of them share this
host (NodeAddr 127.0.0.1), so the node names themselves do not resolve.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from meshserve.parallel.comm.broadcast import process_alive

DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


POLL_S = 0.25
"""How often `sbatch` looks whether its job has ended."""

ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "RESIZING",
                 "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT",
                 "STOPPED", "RESV_DEL_HOLD"}
"""Job states of a job that has not ended (scontrol's JobState)."""


def missing_reason() -> str | None:
    """Why a local Slurm cannot run here, or None when it can."""
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        return (f"slurm-wlm is not installed ({', '.join(absent)} missing): "
                "`apt-get install slurm-wlm` (./install.sh --dev does it where apt works)")
    if os.geteuid() != 0:
        return "the local Slurm runs its daemons as root (SlurmUser=root, auth/none)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalSlurm:
    """`num_nodes` emulated nodes of `cpus` CPUs each, in one partition."""

    def __init__(self, root: Path, num_nodes: int = 2, cpus: int = 2) -> None:
        self.root, self.num_nodes, self.cpus = root, num_nodes, cpus
        self.nodes = [f"node{i}" for i in range(1, num_nodes + 1)]
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def _write_conf(self) -> None:
        ctl, *ports = _free_ports(1 + self.num_nodes)
        r = self.root
        for d in ("state", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        for n in self.nodes:
            (r / "spool" / n).mkdir(parents=True, exist_ok=True)
            (r / "tmp" / n).mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(
            f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
            f"CPUs={self.cpus} Port={p} State=UNKNOWN" for n, p in zip(self.nodes, ports))
        self.conf.write_text(f"""\
ClusterName=meshserve-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctl}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmdParameters=config_overrides
TmpFS={r}/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
{nodes}
PartitionName=debug Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the daemons and wait until every node is idle."""
        self._write_conf()
        conf = str(self.conf)
        subprocess.run(["slurmctld", "-f", conf, "-i"], check=True, env=self.env)
        for n in self.nodes:
            subprocess.run(["slurmd", "-f", conf, "-N", n], check=True, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True,
                                 text=True, env=self.env)
            states = out.stdout.split()
            if len(states) == self.num_nodes and all(s == "idle" for s in states):
                return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"local Slurm not idle within {timeout_s} s; logs in {self.root}/log")

    def pids(self) -> list[int]:
        files = [self.root / f"slurmd-{n}.pid" for n in self.nodes]
        files.append(self.root / "slurmctld.pid")
        return [int(f.read_text()) for f in files if f.is_file() and f.read_text().strip()]

    def stop(self) -> None:
        """Stop the daemons by PID (never by name: other clusters may run here)."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(process_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)

    def sbatch(self, args: list[str], *, env: dict[str, str] | None = None,
               timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """Submit a job and wait for it; the result's returncode is the job's exit code.

        `sbatch --wait` looks at the job at growing intervals (up to 32 s apart), which
        left a 12-second job waited on for 42; this looks every POLL_S."""
        submit = ["sbatch", "--parsable", *args]
        env = {**self.env, **(env or {})}
        done = subprocess.run(submit, capture_output=True, text=True, env=env, timeout=60)
        if done.returncode:
            return done
        job_id = done.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout_s
        while True:
            show = subprocess.run(["scontrol", "-o", "show", "job", job_id],
                                  capture_output=True, text=True, env=env, timeout=60)
            fields = dict(f.split("=", 1) for f in show.stdout.split() if "=" in f)
            state = fields.get("JobState", "")
            if state and state not in ACTIVE_STATES:
                code = int(fields.get("ExitCode", "1:0").partition(":")[0])
                # (a job cancelled, timed out or lost to a node failure may say 0)
                returncode = code if state == "COMPLETED" else code or 1
                return subprocess.CompletedProcess(
                    submit, returncode, done.stdout,
                    done.stderr + ("" if state == "COMPLETED" else f"job {job_id}: {state}\n"))
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=env, capture_output=True)
                raise subprocess.TimeoutExpired(submit, timeout_s)
            time.sleep(POLL_S)

