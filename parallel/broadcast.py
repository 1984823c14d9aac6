"""Picklable objects from one rank to every rank of a CPU (gloo) group.

A message is one broadcast of a fixed-size buffer (length header, then the pickle);
larger messages add a second broadcast for the rest. Receivers run a thread that always
has the next broadcast posted, so the sender rarely waits on a busy rank.
"""

from __future__ import annotations

import pickle
import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

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
        self.num_messages = 0
        self.num_bytes = 0

    def send(self, obj: object) -> None:
        """Broadcast `obj` from this rank (the source)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
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
