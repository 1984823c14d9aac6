"""The parallel layout of a run: validated dimensions, rank placement, process groups.

Mesh axes are ("dp", "pp", "tp"), tp varying fastest. Every group is built once, here,
from one validated `ParallelDims`: the TP and PP groups from a DeviceMesh over the
tensor backend (gloo or NCCL), plus gloo CPU groups for step metadata and results.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshserve.parallel.comm.broadcast import watch_process
from meshserve.parallel.comm.shm_allreduce import ShmAllReduce
from meshserve.parallel.comm.shm_allreduce import supported as shm_supported
from meshserve.parallel.comm.shm_ring import RingKey, ShmRing, connect_rings
from meshserve.parallel.comm.tp_group import TensorParallelGroup
from meshserve.parallel.parallel_config import ParallelConfig
from meshserve.validation import require

MESH_AXES = ("dp", "pp", "tp")

ACTIVATION_SLOT_BYTES = 2 << 20
"""Largest activation message (hidden + residual of a micro-batch) sent through shared
memory between CPU stages on one host; bigger ones (long prefill chunks, for which a few
milliseconds do not matter) go through gloo."""

STEP_SLOT_BYTES = 64 << 10
"""Slot size of the rings that carry the driver's step metadata to the other ranks of its
replica on its host (ShmRing.put_message spreads a bigger message over several slots)."""

RESULT_SLOT_BYTES = 4 << 20
"""Largest result message sent through shared memory to the driver: a pickled step result,
or with a split LM head the last stage's normed rows and logits (rows x (hidden + its part
of the vocabulary))."""

IDLE_TIMEOUT = timedelta(days=365)
"""How long a worker waits for the driver's next step: idle is not failure (see ProcessGroups)."""


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _listed(xs: Sequence[int]) -> str:
    return ", ".join(str(x) for x in xs)


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """tp x pp x dp ranks, checked against the world size and against the model's shape."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "world_size"):
            v = getattr(self, name)
            require(isinstance(v, int) and v >= 1, f"parallel.{name}", v, "an int >= 1")
        if self.tp * self.pp * self.dp != self.world_size:
            raise ValueError(
                f"parallel.tp * parallel.pp * parallel.dp = {self.tp} * {self.pp} * {self.dp} = "
                f"{self.tp * self.pp * self.dp} ranks, but the world has {self.world_size}: "
                "allowed are degrees whose product is the number of ranks started")

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int | None = None) -> ParallelDims:
        """The config's degrees; `world_size` (from the launcher) defaults to their product."""
        return cls(tp=config.tp, pp=config.pp, dp=config.dp,
                   world_size=config.world_size if world_size is None else world_size)

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """Sizes along MESH_AXES."""
        return (self.dp, self.pp, self.tp)

    def check_model(self, *, num_attention_heads: int, num_key_value_heads: int,
                    num_hidden_layers: int, intermediate_size: int) -> None:
        """ValueError naming the parallel degree a model shape cannot be split by."""
        tp, pp = self.tp, self.pp
        if num_attention_heads % tp:
            raise ValueError(f"parallel.tp={tp} does not divide num_attention_heads="
                             f"{num_attention_heads}: allowed tp: "
                             f"{_listed(divisors(num_attention_heads))}")
        if num_key_value_heads % tp and tp % num_key_value_heads:
            raise ValueError(f"parallel.tp={tp} neither divides nor is a multiple of "
                             f"num_key_value_heads={num_key_value_heads}: allowed is a divisor "
                             "(KV heads split) or a multiple (KV heads replicated)")
        if intermediate_size % tp:
            raise ValueError(f"parallel.tp={tp} does not divide intermediate_size="
                             f"{intermediate_size}: allowed tp: {_listed(divisors(intermediate_size))}")
        if pp > num_hidden_layers:
            raise ValueError(f"parallel.pp={pp} exceeds num_hidden_layers={num_hidden_layers}: "
                             "every stage needs at least one layer")


def mesh_order(node_ids: Sequence[str], dims: ParallelDims) -> list[int]:
    """Global ranks in mesh order (dp, pp, tp): each TP group on one node, PP neighbours
    free to cross nodes. `node_ids[r]` is the node the launcher put rank r on.

    Nodes are taken in order of their lowest rank and their ranks in increasing order, so
    rank 0 always sits at mesh position (0, 0, 0), the driver's.
    """
    require(len(node_ids) == dims.world_size, "node_ids", len(node_ids),
            f"one per rank ({dims.world_size})")
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(rank)
    for node, ranks in by_node.items():
        if len(ranks) % dims.tp:
            raise ValueError(
                f"parallel.tp={dims.tp}: node {node!r} has {len(ranks)} ranks, so a "
                "tensor-parallel group would span nodes; allowed is a tp that divides every "
                f"node's rank count ({', '.join(f'{n}: {len(r)}' for n, r in by_node.items())})")
    order = [r for ranks in by_node.values() for r in ranks]
    assert order[0] == 0 and sorted(order) == list(range(dims.world_size)), order
    return order


def place_replicas(node_ids: Sequence[str], layouts: Sequence[tuple[int, int]]
                   ) -> list[list[int]]:
    """Each replica's global ranks in its mesh order (pp, tp), for replicas of their own
    (tp, pp) each: the ranks in `mesh_order`' order (by node) cut into consecutive
    replicas, so replica 0 starts at rank 0 and each TP group stays on one node."""
    require(len(node_ids) == sum(tp * pp for tp, pp in layouts), "node_ids", len(node_ids),
            f"one per rank of the replicas ({sum(tp * pp for tp, pp in layouts)})")
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        by_node.setdefault(node, []).append(rank)
    order = [r for ranks in by_node.values() for r in ranks]
    out, at = [], 0
    for i, (tp, pp) in enumerate(layouts):
        ranks = order[at:at + tp * pp]
        at += tp * pp
        for g in range(pp):
            group = ranks[g * tp:(g + 1) * tp]
            if len({node_ids[r] for r in group}) > 1:
                raise ValueError(
                    f"replica {i} (tp={tp}, pp={pp}): its tensor-parallel group of ranks "
                    f"{group} would span nodes {sorted({node_ids[r] for r in group})}; "
                    "allowed are replicas whose TP groups fit the ranks each node has "
                    f"({', '.join(f'{n}: {len(r)}' for n, r in by_node.items())}), taken "
                    "in order")
        out.append(ranks)
    return out


@dataclass(frozen=True, kw_only=True)
class ProcessGroups:
    """This rank's place in the mesh and every group it talks on.

    Groups are created with the process group's (startup) timeout; on gloo, steady-state
    waits are bounded by `op_timeout` instead, passed to each wait. The exception: workers
    wait for the driver's next step on `cpu_group` without a bound (IDLE_TIMEOUT), since an
    idle driver is no failure; the driver notices a dead or stuck rank and stops them all.
    """

    dims: ParallelDims
    rank: int
    mesh: DeviceMesh
    dp_rank: int
    pp_rank: int
    tp_rank: int
    tp: TensorParallelGroup
    pp_group: dist.ProcessGroup | None
    """Same tp rank, every stage; None at pp == 1."""
    cpu_group: dist.ProcessGroup
    """gloo, every rank of this replica (metadata from the driver)."""
    result_group: dist.ProcessGroup | None
    """gloo, the driver and the sampling rank (sampled tokens); None at pp == 1."""
    driver_rank: int
    """Global rank of this replica's driver (stage 0, TP rank 0)."""
    sampler_rank: int
    """Global rank that samples: the last stage's TP rank 0, or the driver when the LM
    head is split between the first and the last stage."""
    last_stage_rank: int
    """Global rank of this replica's last stage at TP rank 0 (its logits leave from there)."""
    op_timeout: timedelta | None
    """Longest wait on another rank once running (gloo); None: the group's own (NCCL)."""
    rings: dict[RingKey, ShmRing] = field(default_factory=dict)
    """Shared-memory rings this rank sends or receives on: ("act", stage, next stage) for
    activations, ("result", sampler, driver) for sampled tokens, ("step", driver, rank)
    for the step metadata (CPU, same host only; step rings only where the whole replica
    shares its driver's host)."""
    local_pids: dict[int, int] = field(default_factory=dict)
    """Process ids of the ranks on this host, by global rank, where this rank waits on
    them through shared memory (rings, shared-memory AllReduce); empty elsewhere."""

    @property
    def is_driver(self) -> bool:
        """Whether this rank runs the scheduler."""
        return self.rank == self.driver_rank

    @property
    def is_sampler(self) -> bool:
        """Whether this rank samples tokens."""
        return self.rank == self.sampler_rank

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank embeds tokens."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes logits."""
        return self.pp_rank == self.dims.pp - 1

    def replica_ranks(self) -> list[int]:
        """Global ranks of this rank's replica (dp coordinate), the driver first."""
        return [int(r) for r in self.mesh.mesh[self.dp_rank].flatten()]

    def step_rings(self) -> list[ShmRing] | None:
        """(Driver) The rings to every other rank of its replica, or None where there are
        none: the step metadata then goes by gloo broadcast."""
        keys = [("step", self.rank, r) for r in self.replica_ranks() if r != self.rank]
        if not keys or any(k not in self.rings for k in keys):
            return None
        return [self.rings[k] for k in keys]

    def watch(self, rank: int) -> Callable[[], None]:
        """A check for polling loops that raises RuntimeError once `rank` (on this host)
        has exited; a no-op for a rank whose process this rank cannot see."""
        pid = self.local_pids.get(rank)
        return (lambda: None) if pid is None else watch_process(pid, self.describe(rank))

    def watch_all(self, ranks: Sequence[int]) -> Callable[[], None]:
        """One check over several ranks (see `watch`)."""
        checks = [self.watch(r) for r in ranks if r in self.local_pids]

        def check() -> None:
            for c in checks:
                c()

        return check

    def describe(self, rank: int | None = None) -> str:
        """'rank 3 (dp 0, pp stage 1 of 2, tp rank 1 of 2)' for logs and errors."""
        rank = self.rank if rank is None else rank
        coords = (self.mesh.mesh == rank).nonzero()[0].tolist()
        dp, pp, tp = coords
        d = self.dims
        where = f"pp stage {pp} of {d.pp}, tp rank {tp} of {d.tp}"
        return f"rank {rank} ({f'dp {dp}, ' if d.dp > 1 else ''}{where})"

    @classmethod
    def build(cls, dims: ParallelDims, *, rank: int, node_ids: Sequence[str],
              device_type: str, op_timeout: timedelta | None,
              cpu_allreduce: str = "auto", cpu_p2p: str = "auto",
              p2p_slots: int = 2, split_head: bool = False) -> ProcessGroups:
        """Create every group; all ranks call this together, after init_process_group.

        On CPU, a TP group whose ranks share one host sums through shared memory
        (cpu_allreduce auto) or through gloo (cpu_allreduce gloo). Likewise pipeline
        neighbours on one host pass activations, and the sampling rank its results, through
        shared-memory rings of `p2p_slots` messages (cpu_p2p auto) or through gloo.
        `split_head`: the driver samples (the LM head is split between first and last stage)."""
        order = mesh_order(node_ids, dims)
        mesh = DeviceMesh(device_type, torch.tensor(order).view(dims.mesh_shape),
                          mesh_dim_names=MESH_AXES)
        coords = mesh.get_coordinate()
        assert coords is not None, rank
        dp_rank, pp_rank, tp_rank = coords
        grid = mesh.mesh  # [dp, pp, tp] global ranks
        tp = TensorParallelGroup()
        if dims.tp > 1:
            group = mesh.get_group("tp")
            hosts = {node_ids[int(r)] for r in grid[dp_rank, pp_rank]}
            shm = (ShmAllReduce(group, tp_rank, dims.tp, timeout=op_timeout)
                   if cpu_allreduce == "auto" and device_type == "cpu" and len(hosts) == 1
                   and shm_supported() else None)
            tp = TensorParallelGroup(tp_rank, dims.tp, group, timeout=op_timeout, shm=shm)
        pp_group = mesh.get_group("pp") if dims.pp > 1 else None
        cpu_group = None
        for d in range(dims.dp):  # every rank creates every group, in the same order
            driver = rank == int(grid[d, 0, 0])
            g = dist.new_group(grid[d].flatten().tolist(), backend="gloo",
                               timeout=None if driver else IDLE_TIMEOUT)
            if d == dp_rank:
                cpu_group = g
        result_group = None
        if dims.pp > 1:
            for d in range(dims.dp):
                g = dist.new_group([int(grid[d, 0, 0]), int(grid[d, -1, 0])], backend="gloo")
                if d == dp_rank:
                    result_group = g
        assert cpu_group is not None
        rings: dict[RingKey, ShmRing] = {}
        on_shm = device_type == "cpu" and shm_supported()
        if on_shm and (dims.pp > 1 or dims.tp > 1) and cpu_p2p == "auto":
            wanted = [(key, p2p_slots, size) for key, size in _ring_keys(grid)
                      if dims.pp > 1 and node_ids[key[1]] == node_ids[key[2]]]
            wanted += [(key, p2p_slots + 1, STEP_SLOT_BYTES)
                       for key in _step_ring_keys(grid, node_ids)]
            rings = connect_rings(wanted, rank, timeout_s=(
                op_timeout.total_seconds() if op_timeout is not None else None))
        local_pids: dict[int, int] = {}
        if on_shm and (dims.pp > 1 or dims.tp > 1):  # every rank or none
            pids: list[int | None] = [None] * dist.get_world_size()
            dist.all_gather_object(pids, os.getpid())
            local_pids = {r: int(pid) for r, pid in enumerate(pids)
                          if pid is not None and r != rank and node_ids[r] == node_ids[rank]}
        groups = cls(dims=dims, rank=rank, mesh=mesh, dp_rank=dp_rank, pp_rank=pp_rank,
                     tp_rank=tp_rank, tp=tp, pp_group=pp_group, cpu_group=cpu_group,
                     result_group=result_group, driver_rank=int(grid[dp_rank, 0, 0]),
                     sampler_rank=int(grid[dp_rank, 0 if split_head else -1, 0]),
                     last_stage_rank=int(grid[dp_rank, -1, 0]), op_timeout=op_timeout,
                     rings=rings, local_pids=local_pids)
        if tp.shm is not None:  # a dead TP peer fails the next sum at once, not at its timeout
            tp.shm.watch_peers(groups.watch_all([int(r) for r in grid[dp_rank, pp_rank]]))
        return groups

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of stage `pp_rank` at this rank's dp and tp coordinates."""
        return int(self.mesh.mesh[self.dp_rank, pp_rank, self.tp_rank])

    def destroy(self) -> None:
        """Tear down every process group of this process (explicitly: gloo may abort at
        interpreter exit otherwise)."""
        if self.tp.shm is not None:
            self.tp.shm.close()
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def _step_ring_keys(grid: torch.Tensor, node_ids: Sequence[str]) -> list[RingKey]:
    """The step-metadata rings of a [dp, pp, tp] rank grid: from each replica whose ranks
    all share one host, its driver to each other rank of it."""
    keys: list[RingKey] = []
    for d in range(grid.shape[0]):
        ranks = [int(r) for r in grid[d].flatten()]
        if len({node_ids[r] for r in ranks}) == 1:
            keys += [("step", ranks[0], r) for r in ranks[1:]]
    return keys


def _ring_keys(grid: torch.Tensor) -> list[tuple[RingKey, int]]:
    """Every pipeline ring of a [dp, pp, tp] rank grid with its slot size: each stage to the
    next at the same tp rank, and each replica's sampler to its driver."""
    dp, pp, tp = grid.shape
    keys: list[tuple[RingKey, int]] = []
    for d in range(dp):
        for s in range(pp - 1):
            keys += [(("act", int(grid[d, s, t]), int(grid[d, s + 1, t])), ACTIVATION_SLOT_BYTES)
                     for t in range(tp)]
        keys.append((("result", int(grid[d, -1, 0]), int(grid[d, 0, 0])), RESULT_SLOT_BYTES))
    return keys
