"""The Plan the runtime consumes: degrees, where every rank runs, which layers each stage has.

Ranks follow the mesh axes ("dp", "pp", "tp") with tp varying fastest (as parallel/comm/mesh.py
builds its groups), and rank r runs on the r-th device counting node by node. A TP group is
then tp consecutive devices: it stays inside an NVLink domain exactly when tp divides the
domain size. Consecutive stages of a replica are tp devices apart, so PP is what crosses
nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.cost_model import Layout
from meshserve.validation import require

ROLES = ("mixed", "prefill", "decode")


@dataclass(frozen=True, kw_only=True)
class RankPlacement:
    """Where one rank runs and what it does."""

    rank: int
    """Global rank."""
    node: int
    """Node index."""
    local_device: int
    """Device index on its node (CUDA_VISIBLE_DEVICES order)."""
    dp_rank: int
    """Replica."""
    pp_rank: int
    """Pipeline stage."""
    tp_rank: int
    """Rank inside its TP group."""
    role: str = "mixed"
    """mixed (prefill and decode), or prefill / decode once serving is disaggregated."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A layout the runtime can start: degrees, rank placement, stage layer ranges."""

    tp: int
    """Tensor-parallel degree."""
    pp: int
    """Pipeline stages."""
    dp: int
    """Replicas."""
    num_micro_batches: int
    """Micro-batches in flight during decode (1 when pp == 1)."""
    stage_layers: tuple[tuple[int, int], ...]
    """[start, end) decoder layers of each stage."""
    placements: tuple[RankPlacement, ...]
    """One per rank, in rank order."""
    prefill_decode_split: tuple[int, int] | None = None
    """Replicas doing prefill and decode when disaggregated; null: every replica does both."""
    warnings: tuple[str, ...] = ()
    """Rules the plan had to break (a TP group across NVLink domains) and why."""
    explanation: str = ""
    """Why this plan was chosen."""
    candidates: tuple[Any, ...] = field(default=(), compare=False)
    """Every candidate the planner weighed (planner.Candidate), best first."""

    def __post_init__(self) -> None:
        require(len(self.placements) == self.world_size, "plan.placements", len(self.placements),
                f"tp*pp*dp = {self.world_size} placements")
        require(len(self.stage_layers) == self.pp, "plan.stage_layers", self.stage_layers,
                f"{self.pp} ranges")

    @property
    def world_size(self) -> int:
        """Ranks the plan needs."""
        return self.tp * self.pp * self.dp

    def rank_of(self, *, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        """The global rank at these mesh coordinates."""
        return (dp_rank * self.pp + pp_rank) * self.tp + tp_rank


def place_ranks(tp: int, pp: int, dp: int, cluster: ClusterConfig) -> tuple[RankPlacement, ...]:
    """Every rank's node and device: rank r on device r, mesh axes (dp, pp, tp), tp fastest."""
    world = tp * pp * dp
    require(world <= cluster.num_devices, "parallel.tp*pp*dp", world,
            f"at most the cluster's {cluster.num_devices} devices")
    per_node = cluster.devices_per_node
    return tuple(RankPlacement(rank=r, node=r // per_node, local_device=r % per_node,
                               dp_rank=r // (tp * pp), pp_rank=r // tp % pp, tp_rank=r % tp)
                 for r in range(world))


def tp_within_domain(tp: int, cluster: ClusterConfig) -> bool:
    """Whether every TP group of tp consecutive devices stays inside one NVLink domain."""
    return cluster.nvlink_domain_size % tp == 0


def layout_for(tp: int, stage_layers: list[tuple[int, int]], num_micro_batches: int,
               cluster: ClusterConfig, head_first_fraction: float = 0.0) -> Layout:
    """The cost model's view of replica 0 placed on `cluster` (`head_first_fraction`: the
    share of a split LM head on stage 0)."""
    pp = len(stage_layers)
    places = place_ranks(tp, pp, 1, cluster)
    nodes = [places[s * tp].node for s in range(pp)]
    return Layout(tp=tp, stage_layers=tuple(end - start for start, end in stage_layers),
                  num_micro_batches=num_micro_batches if pp > 1 else 1,
                  tp_link="intra" if tp_within_domain(tp, cluster) else "inter",
                  stage_links=tuple("intra" if a == b else "inter"
                                    for a, b in zip(nodes, nodes[1:])),
                  active_devices_per_node=min(cluster.devices_per_node, tp * pp),
                  head_first_fraction=head_first_fraction)

