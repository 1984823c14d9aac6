"""Which launcher started this process, and where it stands among the run's ranks.

`discover()` reads the environment a launcher leaves behind and returns one validated
`LaunchEnv`, or None when nothing launched us (then the driver self-spawns its ranks).
Launchers are tried in this order, the first one whose variables are present wins:

- torchrun and DeepSpeed's launcher: RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR ...
  (the env:// convention; torchrun's agent may host the store itself);
- MPI (mpirun / mpiexec of Open MPI or MPICH): OMPI_COMM_WORLD_* or PMI_RANK / PMI_SIZE
  outside a Slurm step; the rendezvous address is broadcast from rank 0 with mpi4py.
  MPI comes before Slurm because Open MPI's mpirun inside an allocation starts its
  daemons with srun, so SLURM_PROCID there numbers daemons, not ranks;
- Slurm (srun, one task per rank): SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID /
  SLURM_NODEID inside a job step (SLURM_STEP_ID set; a batch script itself is not a step).
  The rendezvous host is the first node of the step's node list (`scontrol show
  hostnames`), the port derived from the job and step ids unless MASTER_PORT is set.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

LAUNCHERS = ("torchrun", "deepspeed", "env", "mpi", "slurm", "self-spawn")


class LaunchError(ValueError):
    """The launcher's variables are missing, malformed or contradict each other."""


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """This process's place in a run, as its launcher described it."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    agent_store: bool = False
    """torchrun's agent already hosts the rendezvous store (rank 0 must not start one)."""
    world: LaunchEnv | None = None
    """For one replica's own world carved out of a launched one (`rank` and `world_size`
    then count that replica's ranks): the launched world's environment. Node and local
    fields stay the launched world's, so devices and hosts are the real ones."""
    namespace: str = ""
    """With `world`: the replica's keys in the launched world's store."""

    def __post_init__(self) -> None:
        bound = self.world_size if self.world is None else self.world.world_size
        checks = (
            (self.world_size >= 1, "world size", self.world_size, ">= 1"),
            (0 <= self.rank < self.world_size, "rank", self.rank,
             f"0 <= rank < world size {self.world_size}"),
            (1 <= self.local_world_size <= bound, "local world size",
             self.local_world_size, f"1 ..{bound} (the world size)"),
            (0 <= self.local_rank < self.local_world_size, "local rank", self.local_rank,
             f"0 <= local rank < local world size {self.local_world_size}"),
            (1 <= self.num_nodes <= bound, "node count", self.num_nodes,
             f"1 ..{bound} (the world size)"),
            (0 <= self.node_rank < self.num_nodes, "node index", self.node_rank,
             f"0 <= node index < node count {self.num_nodes}"),
            (0 < self.master_port < 65536, "rendezvous port", self.master_port, "1 ..65535"),
            (bool(self.master_addr), "rendezvous address", self.master_addr, "a host name"),
        )
        for ok, what, value, allowed in checks:
            if not ok:
                raise LaunchError(f"{self.launcher} launch: {what}={value!r} is invalid: "
                                  f"allowed is {allowed}")

    @property
    def node_id(self) -> str:
        """A name for this rank's node that ranks compare to group ranks by node."""
        return f"node{self.node_rank}"

    @property
    def is_worker(self) -> bool:
        """Whether this rank serves the driver rather than running the scheduler."""
        return self.rank != 0

    def describe(self) -> str:
        return (f"{self.launcher}: rank {self.rank}/{self.world_size}, local "
                f"{self.local_rank}/{self.local_world_size}, node {self.node_rank}/"
                f"{self.num_nodes}, rendezvous {self.master_addr}:{self.master_port}")


def _int(env: Mapping[str, str], name: str, launcher: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        if default is None:
            raise LaunchError(f"{launcher} launch: {name} is not set: allowed is an integer, "
                              f"as {launcher} sets it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"{launcher} launch: {name}={raw!r} is invalid: allowed is an "
                          "integer") from None


def discover(env: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """The launch environment of this process, or None when no launcher started it.

    Without `env`, the answer for this process is computed once and kept: under MPI it
    takes collectives, which every rank must call equally often.
    """
    if env is None:
        return _discover_this_process()
    if "RANK" in env or "WORLD_SIZE" in env:
        return _from_env_convention(env)
    if "OMPI_COMM_WORLD_RANK" in env or ("PMI_RANK" in env and "SLURM_STEP_ID" not in env):
        return _from_mpi(env)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _from_slurm(env)
    return None


@functools.cache
def _discover_this_process() -> LaunchEnv | None:
    return discover(dict(os.environ))


def _from_env_convention(env: Mapping[str, str]) -> LaunchEnv:
    """torchrun, DeepSpeed's launcher, or anything else following env://."""
    if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
        launcher = "torchrun"
    elif "CROSS_RANK" in env or "LOCAL_SIZE" in env:
        launcher = "deepspeed"
    else:
        launcher = "env"
    rank, world = _int(env, "RANK", launcher), _int(env, "WORLD_SIZE", launcher)
    local_world = _int(env, "LOCAL_WORLD_SIZE", launcher,
                       _int(env, "LOCAL_SIZE", launcher, world))
    local_rank = _int(env, "LOCAL_RANK", launcher, rank % max(local_world, 1))
    num_nodes = _int(env, "GROUP_WORLD_SIZE", launcher,
                     _int(env, "CROSS_SIZE", launcher, max(1, world // max(local_world, 1))))
    node_rank = _int(env, "GROUP_RANK", launcher,
                     _int(env, "CROSS_RANK", launcher, rank // max(local_world, 1)))
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise LaunchError(f"{launcher} launch: RANK/WORLD_SIZE are set but MASTER_ADDR / "
                          "MASTER_PORT are not: allowed is all four (the env:// rendezvous)")
    return LaunchEnv(launcher=launcher, rank=rank, world_size=world, local_rank=local_rank,
                     local_world_size=local_world, node_rank=node_rank, num_nodes=num_nodes,
                     master_addr=env["MASTER_ADDR"],
                     master_port=_int(env, "MASTER_PORT", launcher),
                     agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


# --- Slurm ---------------------------------------------------------------------------------


def expand_hostlist(hostlist: str) -> list[str]:
    """`node[1-3,7],gpu01` -> node1 node2 node3 node7 gpu01, where `scontrol` is absent."""
    try:
        return expand_nodelist(hostlist)
    except ValueError:
        raise LaunchError(f"slurm launch: node list {hostlist!r} is invalid: allowed is "
                          "Slurm's host list syntax, e.g. node[1-4,8]") from None


def slurm_hostnames(hostlist: str) -> list[str]:
    """The host names of a Slurm node list, via `scontrol show hostnames` when available."""
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True,
                             text=True, timeout=30)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    return expand_hostlist(hostlist)


def slurm_node_address(host: str) -> str:
    """An address for `host`: itself when it resolves, else the node's NodeAddr in Slurm."""
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        pass
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "node", host], capture_output=True,
                             text=True, timeout=30)
        m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
        if m:
            return m.group(1)
    raise LaunchError(f"slurm launch: first node {host!r} does not resolve and scontrol has "
                      "no NodeAddr for it: allowed is a resolvable host, or set MASTER_ADDR")


def tasks_on_node(tasks_per_node: str, node_rank: int) -> int:
    """This node's task count from Slurm's compressed form, e.g. '2(x3),1' node 3 -> 1."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise LaunchError(f"slurm launch: SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r} is "
                              "invalid: allowed is Slurm's form, e.g. 2(x3),1")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_rank < len(counts):
        raise LaunchError(f"slurm launch: SLURM_NODEID={node_rank} is invalid: allowed is "
                          f"0 ..{len(counts) - 1} for tasks per node {tasks_per_node!r}")
    return counts[node_rank]


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    """One srun task per rank."""
    world = _int(env, "SLURM_STEP_NUM_TASKS", "slurm", _int(env, "SLURM_NTASKS", "slurm", 1))
    node_rank = _int(env, "SLURM_NODEID", "slurm")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if "MASTER_ADDR" in env:
        addr = env["MASTER_ADDR"]
    elif nodelist:
        addr = slurm_node_address(slurm_hostnames(nodelist)[0])
    else:
        raise LaunchError("slurm launch: SLURM_STEP_NODELIST is not set: allowed is an srun "
                          "step, or set MASTER_ADDR")
    job, step = _int(env, "SLURM_JOB_ID", "slurm", 0), _int(env, "SLURM_STEP_ID", "slurm", 0)
    port = _int(env, "MASTER_PORT", "slurm", 20000 + (job % 4000) * 10 + step % 10)
    return LaunchEnv(launcher="slurm", rank=_int(env, "SLURM_PROCID", "slurm"),
                     world_size=world, local_rank=_int(env, "SLURM_LOCALID", "slurm"),
                     local_world_size=tasks_on_node(per_node, node_rank), node_rank=node_rank,
                     num_nodes=_int(env, "SLURM_STEP_NUM_NODES", "slurm",
                                    _int(env, "SLURM_NNODES", "slurm", 1)),
                     master_addr=addr, master_port=port)


# --- MPI -----------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host != "localhost" else "127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reachable_address() -> str:
    """This host's address as other nodes reach it (the interface of the default route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent for a UDP connect
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _from_mpi(env: Mapping[str, str]) -> LaunchEnv:
    """mpirun / mpiexec: sizes from the MPI runtime, the rendezvous broadcast by rank 0."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchError("mpi launch: OMPI_COMM_WORLD_RANK / PMI_RANK are set but mpi4py is "
                          "not installed: allowed is `pip install mpi4py` (built against the "
                          "same MPI as mpirun)") from None
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_world = local.Get_rank(), local.Get_size()
    hosts = comm.allgather(MPI.Get_processor_name())
    nodes = list(dict.fromkeys(hosts))  # in rank order of first appearance
    rendezvous = None
    if rank == 0:
        addr = env.get("MASTER_ADDR") or ("127.0.0.1" if len(nodes) == 1
                                          else _reachable_address())
        rendezvous = (addr, int(env.get("MASTER_PORT") or free_port(addr)))
    addr, port = comm.bcast(rendezvous, root=0)
    local.Free()
    # MPI's job is done: the ranks talk over torch.distributed from here. Finalizing now
    # (all ranks are here together) means exit needs no MPI handshake, so a rank that
    # exits early with an error is seen by mpirun, which then stops the others.
    MPI.Finalize()
    return LaunchEnv(launcher="mpi", rank=rank, world_size=world, local_rank=local_rank,
                     local_world_size=local_world, node_rank=nodes.index(hosts[rank]),
                     num_nodes=len(nodes), master_addr=addr, master_port=port)


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed node list: 'gpu[01-03,07],login1' -> gpu01 gpu02 gpu03 gpu07 login1."""
    names: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        m = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not m:
            names.append(item)
            continue
        prefix, ranges, rest = m.groups()
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.extend(prefix + str(i).zfill(len(lo)) + tail
                             for tail in expand_nodelist(rest) or [""])
    return names
