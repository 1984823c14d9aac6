"""A replica's messages from the front, read by a thread of their own.

A prefill replica steps for hundreds of milliseconds at a time, and a decode replica
waiting to pull a prompt's KV should not wait for that step to end before the read is
granted. So the inbox's thread takes an Export (begin the lease's read, announce the
grant) as it arrives, under the lock that keeps the replica's loop out of its KV hand-off
meanwhile (the loop never holds it while the engine steps, and an export touches no
engine state: the lease's blocks stay pinned). Every other message is queued for the
replica's loop, in order.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

from meshserve.engine.replicas.messages import (
    Export,
    FrontMessage,
    HandoffCommand,
    HandoffReply,
    ReplicaMessage,
    Stop,
)


@dataclass(frozen=True)
class _Gone:
    """The front closed its end."""


@dataclass(frozen=True)
class _ReadFailed:
    """The reading thread stopped on an error."""

    error: str


_GONE = _Gone()


class Sender(Protocol):
    def send(self, msg: ReplicaMessage) -> None: ...


class Handoff(Protocol):
    """What the inbox needs of a replica's KV hand-off (engine/replicas/kv_handoff.py)."""

    def command(self, msg: HandoffCommand) -> list[HandoffReply]: ...


class Inbox:
    """The front's messages for a replica's loop; exports handled on arrival."""

    def __init__(self, conn: Connection, handoff: Handoff | None, out: Sender) -> None:
        self.conn, self.handoff, self.out = conn, handoff, out
        self.handoff_lock = threading.Lock()
        """Held by whoever uses the KV hand-off's commands (never while the engine steps: its
        step calls into the handoff's stream lister without it, which exports never touch)."""
        self._queue: queue.Queue[FrontMessage | _Gone | _ReadFailed] = queue.Queue()
        self.thread = threading.Thread(target=self._read, name="meshserve-replica-inbox",
                                       daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while True:
                msg: FrontMessage = self.conn.recv()
                if isinstance(msg, Export) and self.handoff is not None:
                    with self.handoff_lock:
                        replies = self.handoff.command(msg)
                    for reply in replies:
                        self.out.send(reply)
                    continue
                self._queue.put(msg)
                if isinstance(msg, Stop):
                    return
        except (EOFError, OSError):
            self._queue.put(_GONE)
        except BaseException as e:  # noqa: BLE001 - the loop reports it to the front
            self._queue.put(_ReadFailed(f"{type(e).__name__}: {e}"))

    def empty(self) -> bool:
        return self._queue.empty()

    def get(self, timeout: float | None) -> FrontMessage | None:
        """The next message (None: none within `timeout`; None as timeout: wait for one).
        EOFError once the front is gone; an error of the reading thread is raised here."""
        try:
            msg = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(msg, _Gone):
            self._queue.put(_GONE)  # (and for any later get)
            raise EOFError("the front is gone")
        if isinstance(msg, _ReadFailed):
            raise RuntimeError(msg.error)
        return msg
