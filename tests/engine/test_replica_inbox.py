"""A replica's inbox: an export is taken as it arrives (the loop may be mid-step), under
the KV role's lock; every other message waits for the loop, in order; a closed front is
EOFError, and an export's error is raised to the loop."""

from __future__ import annotations

import socket
import threading
from multiprocessing.connection import Connection

import pytest

from meshserve.engine.replica_inbox import Inbox


class _Role:
    """Stands in for a KVRole: records the exports it is given, in the lock."""

    def __init__(self, lock_holder: list[Inbox]) -> None:
        self.exports: list[tuple[object, ...]] = []
        self.holder = lock_holder
        self.done = threading.Event()

    def command(self, kind: str, args: tuple[object, ...]) -> list[tuple[object, ...]]:
        assert kind == "export" and self.holder[0].role_lock.locked()
        if args[0] == "bad":
            raise ValueError("no lease")
        self.exports.append(args)
        self.done.set()
        return [("granted", args[0])]


class _Out:
    def __init__(self) -> None:
        self.sent: list[tuple[object, ...]] = []

    def send(self, msg: tuple[object, ...]) -> None:
        self.sent.append(msg)


def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def test_an_export_is_taken_at_once_and_the_rest_waits_in_order() -> None:
    front, mine = _pair()
    holder: list[Inbox] = []
    role, out = _Role(holder), _Out()
    holder.append(Inbox(mine, role, out))  # type: ignore[arg-type]
    inbox = holder[0]
    front.send(("add", 1))
    front.send(("export", "r1", 7))
    front.send(("abort", "r0"))
    assert role.done.wait(5)  # nobody took a message from the inbox meanwhile
    assert role.exports == [("r1", 7)] and out.sent == [("granted", "r1")]
    assert inbox.get(5) == ("add", 1)
    assert inbox.get(5) == ("abort", "r0")
    assert inbox.get(0.0) is None and inbox.empty()
    front.close()
    with pytest.raises(EOFError):
        inbox.get(5)
    with pytest.raises(EOFError):  # and again
        inbox.get(0.0)


def test_an_export_that_fails_is_raised_to_the_loop() -> None:
    front, mine = _pair()
    holder: list[Inbox] = []
    holder.append(Inbox(mine, _Role(holder), _Out()))  # type: ignore[arg-type]
    front.send(("export", "bad", 1))
    with pytest.raises(RuntimeError, match="ValueError: no lease"):
        holder[0].get(5)
    front.close()


def test_stop_ends_the_reading_thread() -> None:
    front, mine = _pair()
    inbox = Inbox(mine, None, _Out())
    front.send(("export", "r", 1))  # no KV role: the loop's to refuse
    front.send(("stop",))
    assert inbox.get(5) == ("export", "r", 1)
    assert inbox.get(5) == ("stop",)
    inbox.thread.join(5)
    assert not inbox.thread.is_alive()
    front.close()
