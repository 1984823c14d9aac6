"""The synchronous Engine on one thread, fed and drained from an asyncio event loop.

Every Engine call happens on the engine thread. Handlers hand it commands (add, abort,
stop) through a thread-safe queue; it hands each request's outputs back to that
request's asyncio queue with `loop.call_soon_threadsafe`. When a step raises (a rank
died, a device error) the engine is dead: every open stream gets an `EngineFailure`,
every later call raises `EngineDeadError`, and `on_failure` runs once. A request whose
data-parallel replica was lost (while others serve on) gets an `EngineFailure` of its own.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from meshserve.engine.client import EngineClient, ReplicaState
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.core.scheduler_output import SchedulerStats
from meshserve.parallel.comm.ranks import failure_reason

SHUTTING_DOWN = "the server is shutting down"
"""`AsyncEngine.failure` after a requested stop (any other value means the engine failed)."""


class EngineDeadError(RuntimeError):
    """The engine failed or was stopped: the server cannot take work any more."""


class OverloadedError(RuntimeError):
    """More requests queued or running than serve.max_pending_requests allows."""


@dataclass(frozen=True)
class EngineFailure:
    """Put on a stream's queue in place of further outputs when the engine dies."""

    message: str


@dataclass(frozen=True)
class Choice:
    """One engine request of an HTTP request: its id, prompt tokens and sampling."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


StreamItem = tuple[int, RequestOutput] | EngineFailure
"""(choice index, output) or the engine's failure."""


@dataclass
class _Add:
    choices: list[Choice]
    stream: asyncio.Queue[StreamItem]
    done: asyncio.Future[None]
    arrival_time: float


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _ResetPrefixCache:
    done: asyncio.Future[int]


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _ResetPrefixCache | _Stop


@dataclass
class _Route:
    stream: asyncio.Queue[StreamItem]
    index: int


@dataclass
class _Deliveries:
    """Items for the event loop, gathered over one step and handed over in one call."""

    items: list[tuple[asyncio.Queue[StreamItem], StreamItem]] = field(default_factory=list)


OutputHook = Callable[[list[RequestOutput]], None]
"""Called on the engine thread with each step's outputs (metrics)."""


class AsyncEngine:
    """Runs `engine` on a thread of its own; coroutines add, stream and abort requests."""

    def __init__(self, engine: EngineClient, *, max_pending: int = 4096, health_interval_s: float = 0.5,
                 on_outputs: OutputHook | None = None,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None
        self.max_pending = max_pending
        self.health_interval_s = health_interval_s
        self.on_outputs = on_outputs
        self.on_failure = on_failure
        self.failure: str | None = None
        """Why the engine stopped taking work (None while it serves)."""
        self.stats: SchedulerStats = engine.stats
        """The latest scheduler snapshot (refreshed after every step and command)."""
        self.replicas: list[ReplicaState] = engine.replica_states()
        """The latest snapshot of every replica (the same refresh)."""
        self.num_routes = 0
        """Engine requests with a live stream (for leak checks)."""
        self._routes: dict[str, _Route] = {}
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._lock = threading.Lock()  # orders `failure` against commands being queued
        self._num_pending = 0
        self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name="meshserve-engine", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; outputs go to queues of `loop`."""
        self.loop = loop
        self._thread.start()

    async def add(self, choices: list[Choice]) -> asyncio.Queue[StreamItem]:
        """Queue the choices (all or none); their outputs arrive on the returned queue.

        Raises ValueError (bad input, naming the field), OverloadedError or EngineDeadError.
        """
        assert self.loop is not None, "add() before start()"
        stream: asyncio.Queue[StreamItem] = asyncio.Queue()
        done: asyncio.Future[None] = self.loop.create_future()
        with self._lock:
            if self.failure is not None:
                raise EngineDeadError(self.failure)
            if self._num_pending + len(choices) > self.max_pending:
                raise OverloadedError(f"{self._num_pending} requests pending; allowed is at most "
                                      f"serve.max_pending_requests={self.max_pending}")
            self._num_pending += len(choices)
            self._command(_Add(choices, stream, done, time.monotonic()))
        try:
            await done
        except asyncio.CancelledError:  # the client left before the engine took them
            self.abort([c.request_id for c in choices])
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their KV blocks (unknown or finished ids are skipped)."""
        with self._lock:
            if self.failure is None:
                self._command(_Abort(list(request_ids)))

    async def reset_prefix_cache(self) -> int:
        """Uncache every KV block no request holds (between benchmark runs); how many."""
        assert self.loop is not None, "reset_prefix_cache() before start()"
        done: asyncio.Future[int] = self.loop.create_future()
        with self._lock:
            if self.failure is not None:
                raise EngineDeadError(self.failure)
            self._command(_ResetPrefixCache(done))
        return await done

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Fail open streams, stop the thread, release the engine's ranks."""
        with self._lock:
            if self.failure is None:
                self._command(_Stop())
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.engine.shutdown()

    def _command(self, cmd: _Command) -> None:
        """Queue `cmd` for the engine thread, cutting short a wait for replicas there."""
        self._commands.put(cmd)
        self.engine.wake()

    # --- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self._threads)  # intra-op threads are set per thread
        try:
            while True:
                if not self._drain(block=not self.engine.has_unfinished()):
                    self._fail(SHUTTING_DOWN, notify=False)
                    return
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self.engine.check_health()
                    self.replicas = self.engine.replica_states()
        except Exception as e:  # noqa: BLE001 - any step error kills the engine; say why
            self._fail(f"engine failed: {failure_reason(e)}", notify=True)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting up to health_interval_s when idle); False on stop."""
        try:
            cmd = self._commands.get(timeout=self.health_interval_s) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(cmd, _Stop):
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _ResetPrefixCache):
                self._post(_settle, cmd.done, None, self.engine.reset_prefix_cache())
            else:
                self._abort(cmd.request_ids)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = self.engine.stats
        self.replicas = self.engine.replica_states()
        return True

    def _add(self, cmd: _Add) -> None:
        added: list[str] = []
        try:
            for c in cmd.choices:
                added.append(self.engine.add_request(c.prompt_token_ids, c.params, c.request_id,
                                                     arrival_time=cmd.arrival_time))
        except ValueError as e:
            for rid in added:
                self.engine.abort(rid)
            self._release(len(cmd.choices))
            self._post(_settle, cmd.done, e)
            return
        for i, c in enumerate(cmd.choices):
            self._routes[c.request_id] = _Route(cmd.stream, i)
        self.num_routes = len(self._routes)
        self._post(_settle, cmd.done, None)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self._routes.pop(rid, None) is not None:
                self.engine.abort(rid)
                self._release(1)
        self.num_routes = len(self._routes)

    def _step(self) -> None:
        outs = self.engine.step()
        self.stats = self.engine.stats
        self.replicas = self.engine.replica_states()
        out_batch = _Deliveries()
        for out in outs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue
            item: StreamItem = (route.index, out) if out.error is None else \
                EngineFailure(out.error)
            out_batch.items.append((route.stream, item))
            if out.finished:
                del self._routes[out.request_id]
                self._release(1)
        self.num_routes = len(self._routes)
        if out_batch.items:
            self._post(_deliver, out_batch)
        if self.on_outputs is not None and outs:
            self.on_outputs(outs)

    def _post(self, fn: Callable[..., None], *args: object) -> None:
        """Run `fn(*args)` on the event loop (dropped once the loop is closed: nobody waits)."""
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def _release(self, n: int) -> None:
        with self._lock:
            self._num_pending -= n

    def _fail(self, message: str, *, notify: bool) -> None:
        """Refuse new work, end every open stream and queued add with `message`."""
        with self._lock:
            self.failure = message
            pending = []
            while True:
                try:
                    pending.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        if notify and self.on_failure is not None:
            self.on_failure(message)
        batch = _Deliveries([(r.stream, EngineFailure(message)) for r in self._routes.values()])
        self._routes.clear()
        self.num_routes = 0
        self._post(_deliver, batch)
        for cmd in pending:
            if isinstance(cmd, (_Add, _ResetPrefixCache)):
                self._post(_settle, cmd.done, EngineDeadError(message))


def _deliver(batch: _Deliveries) -> None:
    for stream, item in batch.items:
        stream.put_nowait(item)


def _settle(fut: asyncio.Future[Any], error: BaseException | None, result: Any = None) -> None:
    if fut.done():  # the waiting handler was cancelled
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
