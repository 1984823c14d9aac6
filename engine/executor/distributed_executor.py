"""The driver's side of a multi-rank run (tensor and/or pipeline parallel).

The driver is rank 0: it runs the engine (one scheduler), broadcasts each micro-batch's
metadata to every rank over a gloo CPU group, runs pipeline stage 0 (TP rank 0) itself,
and collects the tokens the last stage samples. With pp > 1, up to `max_in_flight`
micro-batches are in the pipeline at once: `submit` one, `collect` the oldest.

Under a launcher (torchrun) the other ranks are already running; otherwise the driver
spawns them and owns them: when one dies, all are stopped and the next call raises
RankFailure naming it. A rank silent for `parallel.timeout_s` counts as failed.
"""

from __future__ import annotations

import atexit
import functools
import pickle
import subprocess
import sys
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.engine.config.run import Run
from meshserve.engine.core.sampling_params import SequenceSampling
from meshserve.engine.core.scheduler_output import SchedulerOutput
from meshserve.engine.executor.executor import step_message
from meshserve.engine.executor.rank import (
    STARTUP_TIMEOUT_S,
    check_layout,
    max_in_flight,
    start_rank,
    stats_key,
)
from meshserve.engine.worker.sampling.sampled_tokens import SampledTokens
from meshserve.engine.worker.sampling.step_sampler import StepResult, step_result
from meshserve.engine.worker.worker import StageStats, StatsRequest
from meshserve.parallel.comm.broadcast import ObjectBroadcaster, RingBroadcaster
from meshserve.parallel.comm.p2p import ObjectChannel
from meshserve.parallel.comm.ranks import (
    RankFailure,
    SpawnedRanks,
    failure_reason,
    launcher_store,
    self_spawned_driver,
)
from meshserve.parallel.comm.tp_group import CommCounters

WORKER_MODULE = "meshserve.engine.executor.rank"


class DistributedExecutor:
    """Runs each step over tp x pp ranks; this process is rank 0 (stage 0, TP rank 0)."""

    def __init__(self, run: Run, *, progress: bool = True) -> None:
        t0 = time.perf_counter()
        config = run.config
        world_size = config.parallel.world_size
        env = run.env
        if env is not None and env.is_worker and config.parallel.dp == 1:
            raise ValueError(f"RANK={env.rank}: only rank 0 drives a run; the other ranks "
                             "serve it (meshserve.engine.executor.rank.run_worker_rank)")
        check_layout(run, env.world_size if env else world_size)
        if dist.is_initialized():
            raise ValueError("torch.distributed is already initialized in this process: "
                             "meshserve builds its own process groups; allowed is one "
                             "multi-rank LLM per process, created before any other")
        self.max_in_flight = max_in_flight(run)
        self._failure: str | None = None
        self._timeout_s = config.parallel.timeout_s
        self._num_in_flight = 0
        self._step_id = 0
        self._local: deque[StepResult] = deque()
        self._threads = torch.get_num_threads()
        self._spawned: SpawnedRanks | None = None
        startup = timedelta(seconds=max(STARTUP_TIMEOUT_S, config.parallel.timeout_s))
        if env is None:
            threads = config.threads or max(1, (torch.get_num_threads() or 1) // world_size)
            torch.set_num_threads(threads)
            self._spawned = SpawnedRanks(world_size, WORKER_MODULE,
                                         pickle.dumps(run.for_rank(None)), threads, startup)
            env = self_spawned_driver(world_size, self._spawned.port)
            store = self._spawned.store
        else:
            if config.threads:
                torch.set_num_threads(config.threads)
            store = launcher_store(env, startup)
        assert store is not None
        self._store = store
        self._num_stats_requests = 0
        self._result_wait_s = 0.0
        """(Driver) Seconds waiting for the last stage's tokens: stage 0's idle time."""
        # Runs at interpreter exit too: no spawned rank outlives its driver.
        self._finalizer = weakref.finalize(self, _stop_ranks, self._spawned)
        # A script that ends without shutdown() still ends its ranks cleanly: under a
        # launcher they then exit 0 instead of noticing their driver gone.
        self._at_exit = functools.partial(_shutdown_at_exit, weakref.ref(self))
        atexit.register(self._at_exit)
        try:
            self.groups, self.worker = start_rank(
                run, env, store, progress=progress,
                check=self._spawned.check if self._spawned else lambda: None)
        except BaseException as e:
            cause = self._spawned.wait_for_failure(1.0) if self._spawned is not None else None
            self._stop_after_failure()
            if isinstance(e, RuntimeError) and not isinstance(e, RankFailure):
                raise RankFailure(f"{cause or failure_reason(e)} while the ranks were starting; "
                                  "all ranks stopped") from e
            raise
        self.device = self.worker.device
        self.num_blocks = self.worker.num_blocks
        g = self.groups
        spawned = self._spawned
        step_rings = g.step_rings()
        # While waiting on a rank through shared memory: a self-spawned rank's exit is
        # seen by its Popen (with its exit code), a launcher's rank by its pid.
        alive = spawned.check if spawned else g.watch_all(g.replica_ranks())
        self._broadcaster: ObjectBroadcaster | RingBroadcaster = (
            RingBroadcaster(step_rings, alive=alive)
            if step_rings is not None else
            ObjectBroadcaster(g.cpu_group, src=g.driver_rank, send_timeout=g.op_timeout))
        self._results = (ObjectChannel(g.result_group, self.max_in_flight, g.op_timeout,
                                       ring=g.rings.get(("result", g.sampler_rank, g.rank)),
                                       alive=alive)
                         if g.result_group is not None and not g.is_sampler else None)
        if progress:
            d = self.groups.dims
            replicas = f"dp={d.dp}, " if d.dp > 1 else ""
            print(f"meshserve: {d.world_size} ranks ready ({replicas}tp={d.tp}, pp={d.pp}) in "
                  f"{time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    @property
    def rank_processes(self) -> dict[int, subprocess.Popen[bytes]]:
        """The self-spawned ranks' processes by rank (empty under a launcher)."""
        return dict(self._spawned.procs) if self._spawned is not None else {}

    @property
    def rendezvous_port(self) -> int | None:
        """The self-spawned run's store port on 127.0.0.1 (None under a launcher)."""
        return self._spawned.port if self._spawned is not None else None

    @property
    def comm_counters(self) -> CommCounters:
        """TP collectives this rank (stage 0, TP rank 0) has issued."""
        return self.groups.tp.counters

    def submit(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
               finished: Sequence[int]) -> None:
        """Send a micro-batch into the pipeline and run stage 0 on it."""
        self._check()
        msg = step_message(self._step_id, out, new_seqs, finished)
        self._step_id += 1
        try:
            if self.worker.drafter is not None and not self.worker.whole_model:
                msg = self.worker.fill_drafts(msg)  # a pipeline's drafts, for every stage
            self._broadcaster.send(msg)
            result = self.worker.execute(msg)
        except Exception as e:
            raise self._fail(e) from e
        self._num_in_flight += 1
        if result is not None:  # pp == 1: this rank samples
            self._local.append(result)

    def collect(self) -> StepResult:
        """Tokens of the oldest micro-batch in flight."""
        assert self._num_in_flight > 0, "collect() without submit()"
        self._num_in_flight -= 1
        if self._local:
            return self._local.popleft()
        self._check()
        try:
            result: object
            if self.worker.logits is not None:  # split LM head: this rank samples
                result = self.worker.collect_sampled()
            else:
                assert self._results is not None
                t0 = time.perf_counter()  # stage 0 idles till the last stage's tokens come
                result = self._results.recv(src=self.groups.sampler_rank)
                self._result_wait_s += time.perf_counter() - t0
        except Exception as e:
            raise self._fail(e) from e
        assert isinstance(result, StepResult), result
        return result

    def launch(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
               finished: Sequence[int]) -> SampledTokens:
        """(No pipeline) Queue one step on every rank and return without waiting for its
        tokens (async scheduling): the driver samples, and shares the tokens with the
        other TP ranks on the device, where the next step's placeholders read them."""
        self._check()
        msg = step_message(self._step_id, out, new_seqs, finished)
        self._step_id += 1
        try:
            self._broadcaster.send(msg)
            return self.worker.launch(msg)
        except Exception as e:
            raise self._fail(e) from e

    def resolve(self, sampled: SampledTokens) -> StepResult:
        """The tokens of a launched step (waits for the device)."""
        try:
            return step_result(sampled)
        except Exception as e:
            raise self._fail(e) from e

    def execute(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
                finished: Sequence[int]) -> StepResult:
        """Run one step to completion (no pipelining)."""
        self.submit(out, new_seqs, finished)
        return self.collect()

    def stage_stats(self) -> list[StageStats]:
        """Every rank's busy and waiting time so far, by rank. Micro-batches still in
        flight count where they have already run."""
        self._check()
        request_id = self._num_stats_requests
        self._num_stats_requests += 1
        own = self.worker.stats()  # (and its waits for the last stage's tokens)
        stats = [replace(own, input_wait_s=own.input_wait_s + self._result_wait_s)]
        try:
            self._broadcaster.send(StatsRequest(request_id))
            for rank in range(1, self.groups.dims.world_size):
                key = stats_key(request_id, rank)
                self._store.wait([key], timedelta(seconds=self._timeout_s))
                stats.append(pickle.loads(self._store.get(key)))
                self._store.delete_key(key)
        except Exception as e:
            raise self._fail(e) from e
        return stats

    def check_health(self) -> None:
        """Raise RankFailure if a rank has died (an idle driver sees it without a step)."""
        self._check()

    def _check(self) -> None:
        if self._failure is None and self._spawned is not None and self._spawned.failure:
            self._fail(RankFailure(self._spawned.failure))
        if self._failure is not None:
            raise RankFailure(self._failure)

    def _fail(self, error: BaseException) -> RankFailure:
        """Record why the run broke, stop every rank, and return the error to raise."""
        if self._failure is None:
            # A rank that just died explains the error best; its exit shows within moments.
            cause = self._spawned.wait_for_failure(1.0) if self._spawned is not None else None
            detail = failure_reason(error)
            if cause:
                self._failure = f"{cause}; all ranks stopped"
            elif "timed out" in detail.lower():
                self._failure = (f"a rank did not answer within parallel.timeout_s="
                                 f"{self._timeout_s:g} s ({detail}); all ranks stopped")
            else:
                self._failure = f"a step failed: {detail}; all ranks stopped"
            self._stop_after_failure()
        return RankFailure(self._failure)

    def _stop_after_failure(self) -> None:
        if self._spawned is not None:
            self._spawned.expect_exit()
            self._spawned.stop(grace_s=0.0)
        torch.set_num_threads(self._threads)
        if dist.is_initialized():  # ours: the constructor refuses to share a process
            dist.destroy_process_group()

    def shutdown(self) -> None:
        """Stop every rank, free the process groups and the rendezvous port."""
        if self._failure is not None or not hasattr(self, "groups"):
            return
        self._failure = "the executor was shut down"
        try:
            while self._num_in_flight:  # the sampling rank's sends must be received
                self._drop_oldest()
            if self._spawned is not None:
                self._spawned.expect_exit()
            self._broadcaster.send(None)
            self._broadcaster.flush()
            self.worker.drain()
        except Exception:  # noqa: BLE001 - the ranks are stopped by force below
            pass
        if self._spawned is not None:
            self._spawned.stop(grace_s=10.0)
        self.groups.destroy()
        torch.set_num_threads(self._threads)
        self._finalizer.detach()
        atexit.unregister(self._at_exit)

    def _drop_oldest(self) -> None:
        """Receive and drop the oldest in-flight result (shutdown)."""
        self._num_in_flight -= 1
        if self._local:
            self._local.popleft()
        elif self.worker.logits is not None:
            self.worker.collect_sampled()
        elif self._results is not None:
            self._results.recv(src=self.groups.sampler_rank)


def _shutdown_at_exit(executor: weakref.ref[DistributedExecutor]) -> None:
    """At interpreter exit: shut a still running executor down as shutdown() would."""
    live = executor()
    if live is not None:
        live.shutdown()


def _stop_ranks(spawned: SpawnedRanks | None) -> None:
    """Last resort at interpreter exit: no spawned rank outlives its driver."""
    if spawned is not None:
        spawned.expect_exit()
        spawned.stop(grace_s=0.0)
