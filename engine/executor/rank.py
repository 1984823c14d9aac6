"""A rank's life: join the run, load its stage, then serve the driver's steps until told to stop.

`start_rank` is shared by the driver and the other ranks (each runs the one `Worker`);
`serve_steps` is the loop of every rank but the driver; `python -m
meshserve.engine.executor.rank` is how a self-spawned rank starts.
Any failure ends the rank with a message naming it and a non-zero exit code.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.engine.config.run import Run
from meshserve.engine.executor.executor import rank_device
from meshserve.engine.kv_transfer.agent import replica_store_address, start_kv_thread
from meshserve.engine.worker.worker import StatsRequest, StepMessage, Worker
from meshserve.models.arch import ModelArch
from meshserve.parallel.comm.broadcast import (
    BroadcastInbox,
    ObjectBroadcaster,
    RingInbox,
)
from meshserve.parallel.comm.discovery import LaunchEnv, discover
from meshserve.parallel.comm.mesh import ParallelDims, ProcessGroups
from meshserve.parallel.comm.p2p import ObjectChannel
from meshserve.parallel.comm.ranks import (
    SPAWNED_BY,
    failure_reason,
    launcher_store,
    report_failure,
    store_barrier,
    watch_parent,
)
from meshserve.parallel.comm.store_bytes import store_set
from meshserve.parallel.planner.search import lm_head_split, runtime_stage_ranges

STARTUP_TIMEOUT_S = 600.0
"""Longest wait for every rank to start and load its weights (the run's timeout_s applies
once they have)."""


def max_in_flight(run: Run) -> int:
    """Micro-batches the driver keeps in the pipeline: one per stage unless configured."""
    p = run.config.parallel
    return 1 if p.pp == 1 else (p.num_micro_batches or p.pp)


def check_layout(run: Run, world_size: int) -> ParallelDims:
    """The validated dimensions, or ValueError naming what doesn't fit (before any rank starts)."""
    arch: ModelArch = run.arch
    dims = ParallelDims.from_config(run.config.parallel, world_size)
    dims.check_model(num_attention_heads=arch.num_attention_heads,
                     num_key_value_heads=arch.num_key_value_heads,
                     num_hidden_layers=arch.num_hidden_layers,
                     intermediate_size=arch.intermediate_size)
    return dims


def _backend(run: Run, device: torch.device) -> str:
    backend = run.config.parallel.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError("parallel.backend='nccl' needs device=cuda: allowed on CPU are "
                             "auto and gloo")
        return "cpu:gloo,cuda:nccl"
    return backend


def start_rank(run: Run, env: LaunchEnv, store: dist.Store, *,
               check: Callable[[], None] = lambda: None, progress: bool = False
               ) -> tuple[ProcessGroups, Worker]:
    """Join the process groups, load this rank's stage and agree on the KV block count.

    `check` is called while waiting for other ranks and raises to give up (the driver
    uses it to notice a rank that died during startup).
    """
    config, arch = run.config, run.arch
    dims = check_layout(run, env.world_size)
    device = rank_device(run, env.local_rank)
    startup_s = max(STARTUP_TIMEOUT_S, config.parallel.timeout_s)
    # Ranks start seconds apart and a busy machine stalls them more: groups connect under
    # the startup timeout; once running, every wait on gloo is bounded by timeout_s.
    store_barrier(store, "started", env.world_size, startup_s, check)
    dist.init_process_group(_backend(run, device), store=dist.PrefixStore("pg", store),
                            rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=startup_s))
    node_ids: list[str | None] = [None] * env.world_size
    dist.all_gather_object(node_ids, env.node_id)
    op_timeout = timedelta(seconds=config.parallel.timeout_s) if device.type == "cpu" else None
    groups = ProcessGroups.build(dims, rank=env.rank, node_ids=[str(n) for n in node_ids],
                                 device_type=device.type, op_timeout=op_timeout,
                                 cpu_allreduce=config.parallel.cpu_allreduce,
                                 cpu_p2p=config.parallel.cpu_p2p,
                                 p2p_slots=max_in_flight(run) + 1,
                                 split_head=lm_head_split(config, arch.vocab_size,
                                                          device.type) is not None)
    layer_range = runtime_stage_ranges(config, arch, dims.tp, dims.pp,
                                       device.type)[groups.pp_rank]
    worker = Worker(run.for_rank(env), device, groups=groups, layer_range=layer_range,
                    max_in_flight=max_in_flight(run), progress=progress)
    store_barrier(store, "loaded", env.world_size, startup_s, check)
    num_blocks = torch.tensor([worker.local_num_blocks()], dtype=torch.int64)
    dist.all_reduce(num_blocks, op=dist.ReduceOp.MIN, group=groups.cpu_group)
    worker.allocate(int(num_blocks.item()))
    return groups, worker


def stats_key(request_id: int, rank: int) -> str:
    """Where `rank` puts its StageStats for the driver's StatsRequest `request_id`."""
    return f"stats/{request_id}/{rank}"


def serve_steps(groups: ProcessGroups, worker: Worker, num_in_flight: int,
                store: dist.Store | None = None) -> None:
    """Run every step the driver broadcasts until it broadcasts None; the sampling rank
    sends each step's tokens to the driver. A StatsRequest is answered through `store`."""
    ring = groups.rings.get(("step", groups.driver_rank, groups.rank))
    inbox: BroadcastInbox | RingInbox
    if ring is not None:
        inbox = RingInbox(ring, groups.watch(groups.driver_rank))
    else:
        inbox = BroadcastInbox(ObjectBroadcaster(groups.cpu_group, src=groups.driver_rank))
    results = None
    if groups.is_sampler and groups.result_group is not None:
        results = ObjectChannel(groups.result_group, num_in_flight, groups.op_timeout,
                                ring=groups.rings.get(("result", groups.rank,
                                                       groups.driver_rank)),
                                alive=groups.watch(groups.driver_rank))
    while (msg := inbox.get()) is not None:
        if isinstance(msg, StatsRequest):
            assert store is not None, "stats requested from a rank without the run's store"
            store_set(store, stats_key(msg.request_id, groups.rank), pickle.dumps(worker.stats()))
            continue
        assert isinstance(msg, StepMessage), msg
        result = worker.execute(msg)
        if results is not None:
            results.send(result, dst=groups.driver_rank)
    worker.drain()
    if results is not None:
        results.drain()
    inbox.join()


KV_STOP_WAIT_S = 10.0
"""Longest a rank's exit waits for its KV thread to close its connector."""

_exit_lock = threading.Lock()


def _exit_now(message: str, code: int) -> None:
    """Print and leave at once: after a failure, tearing down gloo could wait on dead peers.
    Callable from any thread (the parent watcher calls it from its own); only the first
    call prints, so a rank that is stopped while it leaves says why once."""
    if threading.current_thread() is threading.main_thread():  # signal() works there only
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if _exit_lock.acquire(blocking=False):
        os.write(2, (message + "\n").encode())
        os._exit(code)
    threading.Event().wait()  # another thread is leaving with its own message and code


def run_worker_rank(run: Run) -> int:
    """A worker rank from start to clean exit (returns 0); on any failure it prints why and
    ends the process (code 2 for a configuration error, 1 otherwise)."""
    env = run.env
    assert env is not None, "a worker rank runs under a launcher or its driver"
    label = f"meshserve rank {env.rank}"
    if run.config.threads:
        torch.set_num_threads(run.config.threads)
    signal.signal(signal.SIGTERM, lambda *_: _exit_now(
        f"{label}: stopped: another rank failed or the driver is shutting down", 143))
    if SPAWNED_BY in os.environ:
        watch_parent(int(os.environ[SPAWNED_BY]),
                     lambda: _exit_now(f"{label}: stopping: the driver (rank 0) is gone", 1))
    store = None
    kv_thread = None
    try:
        # A layout these ranks cannot hold fails here on every rank, before any rank waits
        # for another (the driver checks the same before it serves the rendezvous).
        check_layout(run, env.world_size)
        store = launcher_store(env, timedelta(seconds=STARTUP_TIMEOUT_S))
        groups, worker = start_rank(run, env, store)
        label = f"meshserve {groups.describe()}"
        if run.config.disagg.enabled:  # this rank's share of the replica's KV transfers
            assert worker.runner is not None
            kv_thread = start_kv_thread(
                replica_store_address(env), env.rank, worker.layer_range[0],
                len(worker.runner.kv_cache), groups.tp_rank, groups.dims.tp,
                run.arch.num_key_value_heads, worker.runner.kv_cache)
        serve_steps(groups, worker, max_in_flight(run), store)
    except Exception as e:  # noqa: BLE001 - every failure ends the rank
        reason = failure_reason(e)
        if store is not None:
            report_failure(store, env.rank, reason)
        if isinstance(e, ValueError):  # a configuration the run cannot have
            _exit_now(f"{label}: {reason}", 2)
        _exit_now(f"{label}: stopping after a failure: {reason}", 1)
    if kv_thread is not None:  # told to stop before the steps were (it closes its connector)
        kv_thread.join(KV_STOP_WAIT_S)
    groups.destroy()
    return 0


def main() -> int:
    """Entry point of a self-spawned rank: the driver's resolved Run arrives pickled on stdin."""
    run: Run = pickle.load(sys.stdin.buffer)
    env = discover()
    assert env is not None, "started without RANK / WORLD_SIZE"
    return run_worker_rank(run.for_rank(env))


if __name__ == "__main__":
    sys.exit(main())
