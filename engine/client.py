"""EngineClient: what the offline LLM, the server and the benchmarks speak to.

A lone Engine, the data-parallel front and the disaggregated front all implement it
(engine/build.py picks one for a run); nothing above the engine reaches past it. Its
types live here too: ReplicaState, what a front knows of each replica it serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from meshserve.engine.core.scheduler_output import SchedulerStats

if TYPE_CHECKING:
    from meshserve.engine.config.run import Run
    from meshserve.engine.config.runtime_config import RuntimeConfig
    from meshserve.engine.core.outputs import RequestOutput
    from meshserve.engine.core.sampling_params import SamplingParams
    from meshserve.models.arch import ModelArch
    from meshserve.models.tokenizer import Tokenizer

COLOCATED = "colocated"
"""The role of a replica that runs both prefill and decode."""


@dataclass(frozen=True)
class ReplicaState:
    """One replica as of its latest message to the front (for /health and the
    per-replica metrics)."""

    index: int
    role: str
    num_blocks: int
    stats: SchedulerStats
    down: str | None = None
    """Why the replica is out of service (its ranks died or hung); None while it serves."""

    @property
    def up(self) -> bool:
        return self.down is None


class EngineClient(Protocol):
    """Requests in, outputs out, one `step` at a time, from one thread; `wake` alone may
    be called from another."""

    run: Run
    """The resolved run (parallel=auto and disagg=auto already decided)."""
    config: RuntimeConfig
    """The configuration the run resolved to."""
    arch: ModelArch
    tokenizer: Tokenizer | None
    """None for a model directory without tokenizer.json: prompts must be token ids."""
    num_blocks: int
    """KV blocks of every replica together."""
    max_model_len: int

    @property
    def stats(self) -> SchedulerStats:
        """Scheduler counters, summed over replicas."""
        ...

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt."""
        ...

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; its id. Bad input raises ValueError naming the field."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV; False if it is unknown or already done."""
        ...

    def step(self) -> list[RequestOutput]:
        """Run (or wait for) one step's worth of work; the outputs it produced."""
        ...

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        ...

    def wake(self) -> None:
        """Cut short a `step` waiting for work elsewhere (from any thread)."""
        ...

    def reset_prefix_cache(self) -> int:
        """Uncache every unused cached KV block; how many."""
        ...

    def replica_states(self) -> list[ReplicaState]:
        """Every replica as the front last heard of it."""
        ...

    def check_health(self) -> None:
        """Raise RankFailure when too few replicas or ranks are left to serve."""
        ...

    def shutdown(self) -> None:
        """Stop every replica and rank this client started."""
        ...
