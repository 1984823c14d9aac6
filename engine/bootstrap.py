"""A rank's way into the engine: the front gets an EngineClient, every other rank serves.

One script runs on every rank. Self-spawned ranks never come here (their parent starts
them straight into their loop); under torchrun, srun or mpirun each rank does, and
`start_client` sends every rank but the front (world rank 0) into its own loop, from which
it exits the process when the front shuts down.
"""

from __future__ import annotations

from meshserve.engine.build import make_engine
from meshserve.engine.client import EngineClient
from meshserve.engine.config.run import Run, resolve_run
from meshserve.engine.config.runtime_config import RuntimeConfig
from meshserve.engine.executor.rank import run_worker_rank
from meshserve.engine.replicas.data_parallel import with_step_log_of
from meshserve.engine.replicas.launched import launched_place, launched_replica_run
from meshserve.engine.replicas.replica import serve_launched_replica
from meshserve.parallel.comm.discovery import discover


def serve_unless_front(run: Run) -> None:
    """On a launched rank other than the front: serve until the front shuts down, then
    exit the process with the rank's code. Returns on the front (and when not launched).

    With parallel.dp > 1 the launched world splits into replicas: each other replica's
    driver serves the front, the rest of its ranks their driver."""
    env = run.env
    if env is not None and run.config.parallel.dp > 1:
        place = launched_place(run)
        mine = launched_replica_run(run, place)
        if not place.is_driver:
            raise SystemExit(run_worker_rank(mine))
        if not place.is_front:
            raise SystemExit(serve_launched_replica(with_step_log_of(mine, place.replica),
                                                    place.replica))
    elif env is not None and env.is_worker:
        raise SystemExit(run_worker_rank(run))


def start_client(config: RuntimeConfig, *, progress: bool = True,
                 min_replicas: int | None = None) -> EngineClient:
    """Resolve the run for the ranks this process finds itself among; on the front, the
    engine client for it (on any other rank this serves, then exits the process)."""
    run = resolve_run(config, env=discover(), max_dp=None)  # parallel=auto may plan replicas
    serve_unless_front(run)
    return make_engine(run, progress=progress, min_replicas=min_replicas)
