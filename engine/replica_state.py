"""What the front knows of one replica: its role, its KV cache, its latest counters, and
whether it still serves (for /health and the per-replica metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from meshserve.engine.scheduler_output import SchedulerStats

COLOCATED = "colocated"
"""The role of a replica that runs both prefill and decode."""


@dataclass(frozen=True)
class ReplicaState:
    """One replica as of its latest message to the front."""

    index: int
    role: str
    num_blocks: int
    stats: SchedulerStats
    down: str | None = None
    """Why the replica is out of service (its ranks died or hung); None while it serves."""

    @property
    def up(self) -> bool:
        return self.down is None
