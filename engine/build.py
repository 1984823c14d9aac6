"""The one way in: the engine client a resolved run calls for.

A lone engine for one replica; the data-parallel front for parallel.dp > 1; the
disaggregated front when disagg is on. Each of them speaks `EngineClient`.
"""

from __future__ import annotations

from meshserve.engine.client import EngineClient
from meshserve.engine.config.run import Run
from meshserve.engine.disagg.front import DisaggEngine
from meshserve.engine.engine import Engine
from meshserve.engine.replicas.data_parallel import DataParallelEngine


def make_engine(run: Run, *, progress: bool = True,
                min_replicas: int | None = None) -> EngineClient:
    """One engine, or dp replicas of it behind one front when parallel.dp > 1 (or when
    parallel=auto planned replicas), or prefill and decode replicas behind the
    disaggregated front. Under a launcher this is world rank 0, the front; the other
    replicas' drivers and ranks were started by the launcher. `min_replicas`: the replicas
    that must stay up (None: all of them)."""
    if run.config.disagg.enabled:
        return DisaggEngine(run, progress=progress, min_replicas=min_replicas)
    dp = run.config.parallel.dp
    if min_replicas is not None and not 1 <= min_replicas <= dp:
        raise ValueError(f"serve.min_replicas={min_replicas}: allowed is 1..parallel.dp={dp}")
    if dp == 1:
        return Engine(run, progress=progress)
    return DataParallelEngine(run, progress=progress, min_replicas=min_replicas)
