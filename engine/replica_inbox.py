"""A replica's messages from the front, read by a thread of their own.

A prefill replica steps for hundreds of milliseconds at a time, and a decode replica
waiting to pull a prompt's KV should not wait for that step to end before the read is
granted. So the inbox's thread takes an "export" (begin the lease's read, announce the
grant) as it arrives, under the lock that keeps the replica's loop out of its KV role
meanwhile (the loop never holds it while the engine steps, and an export touches no
engine state: the lease's blocks stay pinned). Every other message is queued for the
replica's loop, in order.
"""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import Connection
from typing import Any, Protocol

from meshserve.engine.kv_transfer import KVRole

_GONE = ("_gone",)


class Sender(Protocol):
    def send(self, msg: tuple[object, ...]) -> None: ...


class Inbox:
    """The front's messages for a replica's loop; exports handled on arrival."""

    def __init__(self, conn: Connection, role: KVRole | None, out: Sender) -> None:
        self.conn, self.role, self.out = conn, role, out
        self.role_lock = threading.Lock()
        """Held by whoever uses the KV role's commands (never while the engine steps: its
        step calls into the role's stream lister without it, which exports never touch)."""
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.thread = threading.Thread(target=self._read, name="meshserve-replica-inbox",
                                       daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                if msg[0] == "export" and self.role is not None:
                    with self.role_lock:
                        replies = self.role.command("export", tuple(msg[1:]))
                    for reply in replies:
                        self.out.send(reply)
                    continue
                self._queue.put(msg)
                if msg[0] == "stop":
                    return
        except (EOFError, OSError):
            self._queue.put(_GONE)
        except BaseException as e:  # noqa: BLE001 - the loop reports it to the front
            self._queue.put(("_error", f"{type(e).__name__}: {e}"))

    def empty(self) -> bool:
        return self._queue.empty()

    def get(self, timeout: float | None) -> tuple[Any, ...] | None:
        """The next message (None: none within `timeout`; None as timeout: wait for one).
        EOFError once the front is gone; an error of the reading thread is raised here."""
        try:
            msg = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if msg is _GONE:
            self._queue.put(_GONE)  # (and for any later get)
            raise EOFError("the front is gone")
        if msg[0] == "_error":
            raise RuntimeError(msg[1])
        return msg
