"""Data parallelism: parallel.dp replicas of the tp x pp layout, each a whole engine.

A replica has its own scheduler, KV cache and ranks; replicas share nothing but the
stream of requests. This process builds replica 0 and steps it in a thread of its own, so
the front (routing, relaying every replica's outputs) never waits on its steps; it starts
replicas 1..dp-1 as child processes, each of which starts its own tp x pp ranks as a lone
engine would. The front talks to every replica alike, over a socket pair. Every
request goes to the replica parallel.router picks (engine/replicas/router.py: by default the one
whose earlier prompts share the longest prefix with it, unless load is out of balance),
and its outputs come back from there with that replica's counters.

A replica is lost when it exits, fails (one of its ranks died), or sends nothing (not even
its heartbeat, once a second) for parallel.timeout_s while it has work; a long step is not
a hang. A lost replica's requests end at once with an error output naming it, it gets no
more requests, and the others keep serving, as long as at least `min_replicas` are left
(the server's serve.min_replicas; offline every replica is needed). Below that the run
stops with a RankFailure naming the replica. Shutdown stops every replica and its ranks.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import fields, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import cast

from meshserve.engine.client import COLOCATED, ReplicaState
from meshserve.engine.config.run import Run
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.core.prefix_cache import PrefixCacheStats
from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.core.scheduler_output import SchedulerStats, SpecDecodeStats
from meshserve.engine.engine import Engine
from meshserve.engine.replicas.gpus import replica_env, replica_gpus, visible_gpus
from meshserve.engine.replicas.launched import (
    FrontListener,
    launched_place,
    launched_replica_run,
)
from meshserve.engine.replicas.messages import (
    Abort,
    Add,
    Beat,
    Failed,
    FrontMessage,
    Granted,
    HandoffReply,
    Held,
    Imported,
    ImportFailed,
    LeaseLapsed,
    Outputs,
    PrefixCacheReset,
    ReadDenied,
    Ready,
    ReplicaMessage,
    ResetPrefixCache,
    Stats,
    Stop,
    StreamRefused,
)
from meshserve.engine.replicas.output_deltas import OutputUnpacker, PackedOutput
from meshserve.engine.replicas.replica import BEAT_S, serve_in_thread
from meshserve.engine.replicas.router import Router
from meshserve.parallel.comm.ranks import RankFailure

STARTUP_TIMEOUT_S = 300.0
"""Longest a replica may take to load its model and start its ranks."""

STOP_TIMEOUT_S = 10.0
"""How long shutdown waits for a replica to stop before killing it."""


def replica_run(run: Run) -> Run:
    """One replica's run: dp=1, and on CPU without an explicit thread count, the cores
    shared evenly by every rank of every replica."""
    config = run.config
    par = config.parallel
    one = replace(config, parallel=replace(par, dp=1))
    if config.threads is None and run.device_type == "cpu":
        one = replace(one, threads=max(1, (os.cpu_count() or 1) // par.world_size))
    return run.with_config(one)


def with_step_log_of(run: Run, replica: int) -> Run:
    """Replica `replica`'s config: its step records in a file of its own (steps.jsonl ->
    steps.replica1.jsonl), so replicas never interleave lines; replica 0 keeps the name."""
    config = run.config
    path = config.engine.step_log
    if not path or replica == 0:
        return run
    p = Path(path)
    own = p.with_name(f"{p.stem}.replica{replica}{p.suffix}")
    return run.with_config(replace(config, engine=replace(config.engine, step_log=str(own))))


def _replica_envs(runs: Sequence[Run]) -> list[dict[str, str] | None]:
    """Each self-spawned replica's environment: on GPUs, the next GPUs of this node for
    its ranks (replica 0, in this process, the first ones); on CPUs, this process's."""
    if runs[0].device_type != "cuda":
        return [None] * len(runs)
    gpus = replica_gpus([r.config.parallel.world_size for r in runs], visible_gpus())
    return [replica_env(g) for g in gpus]


def _sum_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """Counters of several replicas added up."""
    cache = PrefixCacheStats(**{f.name: sum(getattr(s.prefix_cache, f.name) for s in stats)
                                for f in fields(PrefixCacheStats)})
    spec = SpecDecodeStats()
    for s in stats:
        spec.num_drafts += s.spec.num_drafts
        spec.num_draft_tokens += s.spec.num_draft_tokens
        spec.num_accepted_tokens += s.spec.num_accepted_tokens
        per = s.spec.accepted_per_position
        spec.accepted_per_position.extend([0] * (len(per) - len(spec.accepted_per_position)))
        for j, n in enumerate(per):
            spec.accepted_per_position[j] += n
    return SchedulerStats(**{f.name: sum(getattr(s, f.name) for s in stats)
                             for f in fields(SchedulerStats)
                             if f.name not in ("prefix_cache", "spec")},
                          prefix_cache=cache, spec=spec)


class _Remote:
    """The front's handle on one replica: replica 0's thread in this process, a child
    `python -m meshserve.engine.replicas.replica` process (no multiprocessing spawn, which would
    re-run the user's script), both over a socket pair, or under a launcher the replica's
    driver rank, over TCP."""

    def __init__(self, index: int, conn: Connection,
                 proc: subprocess.Popen[bytes] | None = None, rank: int | None = None,
                 thread: threading.Thread | None = None) -> None:
        self.index, self.conn, self.proc, self.rank = index, conn, proc, rank
        self.thread = thread
        self.num_blocks = 0
        self.stats: SchedulerStats | None = None
        self.last_seen = time.monotonic()
        """When it last sent anything (outputs or a heartbeat)."""
        self.outputs = OutputUnpacker()
        """Its requests' outputs so far: it sends what is new in each."""

    @classmethod
    def spawn(cls, index: int, run: Run, env: dict[str, str] | None = None) -> _Remote:
        """Start replica `index` as a child process (in `env`, or this process's
        environment) and send it its Run."""
        mine, theirs = socket.socketpair()
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshserve.engine.replicas.replica", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        remote = cls(index, Connection(mine.detach()), proc=proc)
        remote.conn.send(run)
        return remote

    @classmethod
    def in_thread(cls, index: int, engine: Engine) -> _Remote:
        """Serve `engine`, built here, from a thread of this process."""
        mine, theirs = socket.socketpair()
        thread = serve_in_thread(engine, Connection(theirs.detach()), index)
        return cls(index, Connection(mine.detach()), thread=thread)

    def describe(self) -> str:
        where = ("this process" if self.thread is not None else f"pid {self.proc.pid}"
                 if self.proc is not None else f"driver rank {self.rank}")
        return f"data-parallel replica {self.index} ({where})"

    def exited(self) -> str | None:
        """How its process or thread ended, if it has (a launched driver: None)."""
        if self.proc is not None and self.proc.poll() is not None:
            return f"{self.describe()} exited (code {self.proc.returncode})"
        if self.thread is not None and not self.thread.is_alive():
            return f"{self.describe()} stopped serving"
        return None

    def recv(self) -> ReplicaMessage:
        """The next message; RankFailure when the replica is gone or reported an error."""
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            if self.thread is not None:
                raise RankFailure(f"{self.describe()} stopped serving") from None
            if self.proc is None:
                raise RankFailure(f"{self.describe()} closed its connection (its process "
                                  "exited)") from None
            code = _exit_code(self.proc, 1.0)
            raise RankFailure(f"{self.describe()} exited (code {code})") from None
        if isinstance(msg, Failed):
            raise RankFailure(f"{self.describe()} failed: {msg.error}")
        return msg

    def send(self, msg: FrontMessage) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, OSError):
            raise RankFailure(f"{self.describe()} is gone") from None

    def stop(self) -> None:
        """Ask it to stop; kill it if it does not within STOP_TIMEOUT_S."""
        try:
            self.conn.send(Stop())
        except OSError:
            pass
        if self.proc is not None and _exit_code(self.proc, STOP_TIMEOUT_S) is None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
        if self.thread is not None:  # it shuts its engine down as it ends
            self.thread.join(STOP_TIMEOUT_S)
        self.conn.close()

    def kill(self) -> None:
        """Stop a lost replica at once (its ranks notice their driver is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            _exit_code(self.proc, STOP_TIMEOUT_S)
        self.conn.close()


def _exit_code(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """The process's exit code, waiting up to `timeout`; None if it is still running."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _stop_all(remotes: list[_Remote]) -> None:
    for r in remotes:
        if (r.proc is not None and r.proc.poll() is None) or not r.conn.closed \
                or (r.thread is not None and r.thread.is_alive()):
            r.stop()


class DataParallelEngine:
    """dp engines behind Engine's interface: add_request, step, abort, has_unfinished,
    reset_prefix_cache, stats, shutdown (what LLM, the server and the benchmark use)."""

    def __init__(self, run: Run, *, progress: bool = True,
                 min_replicas: int | None = None) -> None:
        self.run = run
        self.config = config = run.config
        self.dp = config.parallel.dp
        self.min_replicas = self.dp if min_replicas is None else min_replicas
        self.down: dict[int, str] = {}
        """Lost replicas and why."""
        self._timeout_s = config.parallel.timeout_s
        listener = None
        if run.env is not None:  # launched: the world's groups hold every replica
            place = launched_place(run)
            one = launched_replica_run(run, place)
            listener = FrontListener(run)
            self._remotes: list[_Remote] = []
        else:
            one = replica_run(run)
            runs = [with_step_log_of(self._replica_run(one, i), i) for i in range(self.dp)]
            envs = _replica_envs(runs)
            self._remotes = [_Remote.spawn(i, runs[i], envs[i])
                             for i in range(1, self.dp)]  # they load meanwhile
            one = runs[0]
        self._finalizer = weakref.finalize(self, _stop_all, self._remotes)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        try:
            engine = Engine(one, progress=progress)
            self._engine0: Engine | None = engine
            """Replica 0's engine, stepped by its thread; read here only (validation)."""
            self._remotes.insert(0, _Remote.in_thread(0, engine))
            if listener is not None:
                conns = listener.accept(self.dp, max(STARTUP_TIMEOUT_S, self._timeout_s))
                self._remotes += [_Remote(i, conns[i], rank=place.driver_ranks[i])
                                  for i in range(1, self.dp)]
            self._connected()
            for r in self._remotes:
                self._await_ready(r)
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = engine.tokenizer
        self.arch = engine.arch
        self.model_dir = engine.model_dir
        self.max_model_len = engine.max_model_len
        self.device = engine.device
        self.timing = engine.timing
        self.num_blocks = sum(r.num_blocks for r in self._remotes)
        self._ids = itertools.count()
        self._owner: dict[str, int] = {}
        """Unfinished request id -> replica index."""
        self._prompt_of: dict[str, list[int]] = {}
        self._lost: list[RequestOutput] = []
        """Error outputs of a lost replica's requests, not yet returned by step()."""
        self.router = Router(config.parallel.router, self.dp, config.engine.block_size,
                             self._remotes[0].num_blocks)
        self._work_of: dict[str, int] = {}
        self._buffered: list[RequestOutput] = []
        self.requests_per_replica = [0] * self.dp
        """Requests each replica was given (for tests and logs)."""
        if progress:
            how = "launched" if run.env is not None else "started here"
            print(f"meshserve: {self.dp} data-parallel replicas ready ({how}; "
                  f"parallel.router={config.parallel.router})", file=sys.stderr, flush=True)

    def _replica_run(self, one: Run, index: int) -> Run:
        """Hook: replica `index`'s run (every replica's is `one` here)."""
        return one

    def _connected(self) -> None:
        """Hook: replica 0's engine is built and every replica connected (the others may
        still be loading; their readiness is awaited next)."""

    def _role(self, index: int) -> str:
        """Replica `index`'s role (for /health and the metrics' labels)."""
        return COLOCATED

    def _await_ready(self, r: _Remote) -> None:
        timeout = max(STARTUP_TIMEOUT_S, self._timeout_s)
        deadline = time.monotonic() + timeout
        while True:  # heartbeats come while it loads
            if not r.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RankFailure(f"{r.describe()} did not start within {timeout:.0f} s")
            msg = r.recv()
            if isinstance(msg, Ready):
                r.num_blocks, r.stats = msg.num_blocks, msg.stats
                r.last_seen = time.monotonic()
                return

    def check_health(self) -> None:
        """Take out a replica that has died (or one of replica 0's ranks, which an idle
        replica would not see); RankFailure when fewer than min_replicas are left."""
        if 0 not in self.down and self._engine0 is not None:
            try:
                self._engine0.executor.check_health()
            except RankFailure as e:
                self._lose(0, f"{self._remotes[0].describe()}: {e}")
        for r in self._live_remotes():
            why = r.exited()
            if why is not None:
                self._lose(r.index, self._last_words(r) or why)

    def _last_words(self, r: _Remote) -> str | None:
        """The error an ended replica sent before it went, if it did."""
        try:
            while r.conn.poll():
                r.recv()
        except RankFailure as e:
            return str(e)
        except OSError:
            pass
        return None

    def replica_states(self) -> list[ReplicaState]:
        """Every replica: its KV blocks, its latest counters, and whether it is down."""
        self._read_arrived()
        return [ReplicaState(r.index, self._role(r.index), r.num_blocks,
                             r.stats or _sum_stats([]), self.down.get(r.index))
                for r in self._remotes]

    def _live_remotes(self) -> list[_Remote]:
        return [r for r in self._remotes if r.index not in self.down]

    def _lose(self, index: int, reason: str) -> None:
        """Replica `index` is gone: fail its requests, route nothing more to it, stop what
        is left of it; RankFailure instead when fewer than min_replicas would be left."""
        if index in self.down:
            return
        self.down[index] = reason
        left = self.dp - len(self.down)
        if left < self.min_replicas:
            raise RankFailure(f"{reason}; the run cannot go on ({left} of {self.dp} "
                              f"replicas left, {self.min_replicas} needed)")
        print(f"meshserve: {reason}; its requests failed, {left} of {self.dp} replicas "
              "serve on", file=sys.stderr, flush=True)
        self.router.drop(index)
        self._remotes[index].kill()
        error = f"{reason}; the request was lost with it"
        for rid in [rid for rid, owner in self._owner.items() if owner == index]:
            self._lost.append(RequestOutput(rid, self._prompt_of[rid], finished=True,
                                            finish_reason="error", replica=index, error=error))
            self._done(rid)

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt."""
        assert self._engine0 is not None
        return self._engine0.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate here (bad input raises ValueError before any replica sees it), then
        queue on the replica with the least outstanding work."""
        ids, params, request_id, arrival, work = self._admission(prompt, params, request_id,
                                                                 arrival_time)
        chain = self.router.chain(ids)  # hashed once, whatever the retries
        while True:  # a replica found lost on the way gets no request
            target = self.router.pick(ids, work, chain)
            try:
                self._remotes[target].send(Add(ids, params, request_id, arrival))
                break
            except RankFailure as e:
                self.router.done(target, work)
                self._lose(target, str(e))
        self._owner[request_id] = target
        self._prompt_of[request_id] = ids
        self._work_of[request_id] = work
        self.requests_per_replica[target] += 1
        return request_id

    def _admission(self, prompt: str | list[int], params: SamplingParams | None,
                   request_id: str | None, arrival_time: float | None
                   ) -> tuple[list[int], SamplingParams, str, float, int]:
        """A new request's prompt ids, params, id, arrival and work (prompt tokens plus
        tokens allowed); ValueError naming the field for bad input or a reused id."""
        assert self._engine0 is not None
        ids, params = self._engine0.validate(prompt, params)  # (reads nothing it steps)
        if request_id is None:
            request_id = f"dp-{next(self._ids)}"
        if request_id in self._owner:
            raise ValueError(f"request_id={request_id!r} is already in use: allowed is a new id")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        return ids, params, request_id, arrival, len(ids) + params.max_tokens

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it runs; False if it is unknown or already done."""
        owner = self._owner.get(request_id)
        if owner is None:
            return False
        self._done(request_id)
        try:
            self._remotes[owner].send(Abort(request_id))
        except RankFailure as e:
            self._lose(owner, str(e))
        return True

    def _done(self, request_id: str) -> None:
        owner = self._owner.pop(request_id)
        del self._prompt_of[request_id]
        self.router.done(owner, self._work_of.pop(request_id))
        for r in self._remotes:  # aborted or lost: no last output will clear it
            r.outputs.forget(request_id)

    def _busy_remotes(self) -> list[_Remote]:
        return [r for r in self._live_remotes() if self.router.load[r.index] > 0]

    def has_unfinished(self) -> bool:
        """Whether any replica has a request not yet finished (or a lost one's error
        outputs are still to be returned)."""
        return bool(self._owner) or bool(self._lost)

    def wake(self) -> None:
        """Cut short a step() waiting for the replicas (from any thread: the server's, as
        a request arrives)."""
        try:
            self._wake_w.send(b"w")
        except (BlockingIOError, OSError):  # already woken, or shut down
            pass

    def step(self) -> list[RequestOutput]:
        """What the replicas have produced since the last call; while any has work and
        nothing came, wait for its next message (checking every heartbeat for a replica
        silent for parallel.timeout_s, which is lost) unless woken."""
        outs = self._gather()
        kept, self._lost = self._lost, []
        for out in outs:
            returned = self._returned(out)
            if returned is not None:
                kept.append(returned)
        return kept

    def _gather(self) -> list[RequestOutput]:
        outs, self._buffered = self._buffered, []
        came = self._receive_into(outs, timeout=0.0)
        while not came and not outs and not self._lost and not self._buffered \
                and self._busy_remotes():
            came = self._receive_into(outs, timeout=BEAT_S)
            self._check_alive()
        self._check_alive()
        outs, self._buffered = outs + self._buffered, []
        return outs

    def _returned(self, out: RequestOutput) -> RequestOutput | None:
        """`out` as the caller sees it; None for a request no longer here."""
        owner = self._owner.get(out.request_id)
        if owner is None:  # aborted meanwhile, or its replica was lost
            return None
        out.replica = owner
        if out.finished:
            self._done(out.request_id)
        return out

    def _receive_into(self, outs: list[RequestOutput], timeout: float) -> bool:
        """Add the outputs the replicas have sent to `outs`, waiting up to `timeout` for
        any message; whether one came other than a heartbeat (or `wake` cut the wait).
        Idle replicas are read too: their counters, a lapsed lease, an error."""
        live = {r.conn: r for r in self._live_remotes()}
        if not live:
            return False
        came = False
        for conn in wait([*live, self._wake_r], timeout):
            if conn is self._wake_r:
                self._wake_r.recv(4096)
                came = True
                continue
            r = live[cast(Connection, conn)]
            try:
                while r.conn.poll():
                    msg = r.recv()
                    r.last_seen = time.monotonic()
                    if not isinstance(msg, Beat):
                        came = True
                        outs += self._take(r, msg)
            except RankFailure as e:
                came = True
                self._lose(r.index, str(e))
        return came

    def _take(self, r: _Remote, msg: ReplicaMessage) -> list[RequestOutput]:
        """Replica `r`'s message (not a heartbeat): the outputs it carries, if any."""
        match msg:
            case Stats(stats):
                r.stats = stats
                return []
            case Outputs(packed, stats):
                got = self._unpack(r, packed)
                for out in got:
                    out.replica = r.index
                r.stats = stats
                return got
            case Held() | Granted() | ReadDenied() | StreamRefused() | Imported() \
                    | ImportFailed() | LeaseLapsed():
                return self._on_handoff(r.index, msg)
        raise RankFailure(f"{r.describe()} sent an unexpected message {msg!r}")

    def _read_arrived(self) -> None:
        """Handle the messages already here (outputs are kept for the next step)."""
        if hasattr(self, "_buffered"):  # (once started)
            self._receive_into(self._buffered, timeout=0.0)

    def _unpack(self, r: _Remote, packed: list[PackedOutput]) -> list[RequestOutput]:
        """A replica's outputs whole, but for requests that ended here meanwhile (aborted
        while their outputs were on the way)."""
        return r.outputs.unpack([p for p in packed if p.request_id in self._owner])

    def _on_handoff(self, index: int, msg: HandoffReply) -> list[RequestOutput]:
        """Hook: a KV hand-off's message from replica `index` (disaggregated serving)."""
        raise RankFailure(f"data-parallel replica {index} sent a disaggregation message "
                          f"{msg!r}")

    def _check_alive(self) -> None:
        """RankFailure for a replica with work that has sent nothing, not even a
        heartbeat, for parallel.timeout_s (stopped or hung)."""
        now = time.monotonic()
        for r in self._busy_remotes():
            if now - r.last_seen > self._timeout_s:
                self._lose(r.index, f"{r.describe()} sent nothing for parallel.timeout_s="
                                    f"{self._timeout_s} s while it had requests (hung?)")

    def reset_prefix_cache(self) -> int:
        """Uncache every unused cached block on every replica; how many in all."""
        n = 0
        for r in self._live_remotes():
            try:
                n += self._reset_remote(r)
            except RankFailure as e:
                self._lose(r.index, str(e))
        return n

    def _reset_remote(self, r: _Remote) -> int:
        r.send(ResetPrefixCache())
        while True:
            msg = r.recv()
            if isinstance(msg, PrefixCacheReset):
                r.stats = msg.stats
                return msg.num_freed
            if not isinstance(msg, Beat):
                self._buffered += self._take(r, msg)

    @property
    def stats(self) -> SchedulerStats:
        """Every replica's counters added up, as of its latest message."""
        self._read_arrived()
        return _sum_stats([r.stats for r in self._remotes if r.stats is not None])

    def shutdown(self) -> None:
        """Stop every replica and its ranks (replica 0's thread releases its own)."""
        self._finalizer()
        self._engine0 = None
        self._wake_r.close()
        self._wake_w.close()
