"""Picklable objects from one rank to every rank of a CPU (gloo) group.

A message is one broadcast of a fixed-size buffer (length header, then the pickle);
larger messages add a second broadcast for the rest. Receivers run a thread that always
has the next broadcast posted, so the sender rarely waits on a busy rank. Where every
receiver shares the sender's host, RingBroadcaster and RingInbox carry the same messages
through shared-memory rings instead.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from meshserve.parallel.comm.shm_ring import ShmRing

_HEADER = 8  # little-endian int64 payload length


class ObjectBroadcaster:
    """Send (on `src`, waiting at most `send_timeout` for every receiver) or receive
    (elsewhere, waiting as long as it takes) pickled objects over `group`."""

    def __init__(self, group: dist.ProcessGroup, src: int, capacity: int = 1 << 14,
                 send_timeout: timedelta | None = None) -> None:
        assert capacity > _HEADER, capacity
        self.group, self.src, self.capacity = group, src, capacity
        self.send_timeout = send_timeout
        self._buf = torch.zeros(capacity, dtype=torch.uint8)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.num_messages = 0
        self.num_bytes = 0

    def send(self, obj: object) -> None:
        """Broadcast `obj` from this rank (the source). Returns once it is on its way: the
        previous message's broadcast is waited for (and its error raised) here, the last
        one's by `flush()`."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.flush()
        n = len(data)
        payload = torch.frombuffer(bytearray(n.to_bytes(_HEADER, "little") + data),
                                   dtype=torch.uint8)
        first = min(len(payload), self.capacity)
        self._buf[:first].copy_(payload[:first])
        self._send(self._buf)
        if first < len(payload):
            self._send(payload[first:].clone())
        self.num_messages += 1
        self.num_bytes += n

    def _send(self, buf: torch.Tensor) -> None:
        work = dist.broadcast(buf, src=self.src, group=self.group, async_op=True)
        assert work is not None
        self._pending.append((work, buf))

    def flush(self) -> None:
        """Wait (at most `send_timeout` each) until every message sent has gone out."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            if self.send_timeout is None:
                work.wait()
            else:
                work.wait(self.send_timeout)

    def recv(self) -> object:
        """Receive the next object broadcast by the source."""
        buf = self._buf
        dist.broadcast(buf, src=self.src, group=self.group)
        n = int.from_bytes(bytes(buf[:_HEADER].tolist()), "little")
        end = _HEADER + n
        if end <= self.capacity:
            return pickle.loads(buf[_HEADER:end].numpy().tobytes())
        rest = torch.empty(end - self.capacity, dtype=torch.uint8)
        dist.broadcast(rest, src=self.src, group=self.group)
        return pickle.loads(buf[_HEADER:].numpy().tobytes() + rest.numpy().tobytes())


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class BroadcastInbox:
    """Receives broadcasts on a background thread, so the sender never waits for this
    rank to finish its current work; `get()` hands them out in order.

    The thread stops after delivering an object for which `is_last(obj)` is true, or after
    a communication error, which `get()` then raises.
    """

    def __init__(self, broadcaster: ObjectBroadcaster,
                 is_last: Callable[[object], bool] = lambda obj: obj is None) -> None:
        self._broadcaster = broadcaster
        self._is_last = is_last
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="meshserve-inbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                obj = self._broadcaster.recv()
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                self._queue.put(_Failed(e))
                return
            self._queue.put(obj)
            if self._is_last(obj):
                return

    def get(self) -> object:
        """The next object, blocking; re-raises the receiving thread's error."""
        obj = self._queue.get()
        if isinstance(obj, _Failed):
            raise obj.error
        return obj

    def join(self, timeout: float | None = None) -> None:
        """Wait for the receiving thread to end."""
        self._thread.join(timeout)


class RingBroadcaster:
    """ObjectBroadcaster's sending side through shared-memory rings, one to each receiver
    (all on this host): a step's metadata reaches a waiting rank as soon as it looks, and
    the sender pays a pickle and a copy per receiver, no gloo call (whose latency would sit
    on the driver's critical path every micro-batch). Waiting for a full ring is
    bounded by the rings' timeout; `alive` may raise meanwhile (a receiver died)."""

    def __init__(self, rings: Sequence[ShmRing], alive: Callable[[], None] = lambda: None
                 ) -> None:
        assert rings
        self._rings, self._alive = list(rings), alive
        self.num_messages = 0
        self.num_bytes = 0

    def send(self, obj: object) -> None:
        """Post `obj` to every receiver."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        for ring in self._rings:
            ring.put_message(data, self._alive)
        self.num_messages += 1
        self.num_bytes += len(data)

    def flush(self) -> None:
        """Nothing to wait for: a message is in the rings once `send` returns."""


class RingInbox:
    """BroadcastInbox's counterpart for a RingBroadcaster: `get()` takes the next object
    from this rank's ring, waiting as long as it takes (idle is not failure) while
    `watch_sender` (see watch_process) says the sender lives."""

    def __init__(self, ring: ShmRing, watch_sender: Callable[[], None]) -> None:
        self._ring, self._watch = ring, watch_sender

    def get(self) -> object:
        """The next object, blocking."""
        return pickle.loads(self._ring.take_message(self._watch, idle=True))

    def join(self, timeout: float | None = None) -> None:
        """No thread to wait for."""


WATCH_INTERVAL_S = 0.1
"""How often a waiting rank looks whether the process it waits on still runs."""


def watch_process(pid: int, what: str, interval_s: float = WATCH_INTERVAL_S
                  ) -> Callable[[], None]:
    """A check, cheap to call in a polling loop, that raises RuntimeError once process
    `pid` (on this host) has exited; it looks at most every `interval_s`."""
    next_look = 0.0

    def check() -> None:
        nonlocal next_look
        now = time.monotonic()
        if now < next_look:
            return
        next_look = now + interval_s
        if not process_alive(pid):
            raise RuntimeError(f"{what} (pid {pid}) is gone")

    return check


def process_alive(pid: int) -> bool:
    """Whether `pid` runs on this host (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: kill() said it exists
