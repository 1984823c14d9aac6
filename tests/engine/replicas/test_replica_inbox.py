"""A replica's inbox: an export is taken as it arrives (the loop may be mid-step), under
the KV hand-off's lock; every other message waits for the loop, in order; a closed front is
EOFError, and an export's error is raised to the loop."""

from __future__ import annotations

import socket
import threading
from multiprocessing.connection import Connection

import pytest

from meshserve.engine.replicas.inbox import Inbox
from meshserve.engine.replicas.messages import (
    Abort,
    Export,
    Granted,
    HandoffCommand,
    HandoffReply,
    ReplicaMessage,
    ResetPrefixCache,
    Stop,
)


class _Handoff:
    """Stands in for a KVHandoff: records the exports it is given, in the lock."""

    def __init__(self, lock_holder: list[Inbox]) -> None:
        self.exports: list[HandoffCommand] = []
        self.holder = lock_holder
        self.done = threading.Event()

    def command(self, msg: HandoffCommand) -> list[HandoffReply]:
        assert isinstance(msg, Export) and self.holder[0].handoff_lock.locked()
        if msg.request_id == "bad":
            raise ValueError("no lease")
        self.exports.append(msg)
        self.done.set()
        return [Granted(msg.request_id)]


class _Out:
    def __init__(self) -> None:
        self.sent: list[ReplicaMessage] = []

    def send(self, msg: ReplicaMessage) -> None:
        self.sent.append(msg)


def _pair() -> tuple[Connection, Connection]:
    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def test_an_export_is_taken_at_once_and_the_rest_waits_in_order() -> None:
    front, mine = _pair()
    holder: list[Inbox] = []
    handoff, out = _Handoff(holder), _Out()
    holder.append(Inbox(mine, handoff, out))
    inbox = holder[0]
    front.send(ResetPrefixCache())
    front.send(Export("r1", 7))
    front.send(Abort("r0"))
    assert handoff.done.wait(5)  # nobody took a message from the inbox meanwhile
    assert handoff.exports == [Export("r1", 7)] and out.sent == [Granted("r1")]
    assert inbox.get(5) == ResetPrefixCache()
    assert inbox.get(5) == Abort("r0")
    assert inbox.get(0.0) is None and inbox.empty()
    front.close()
    with pytest.raises(EOFError):
        inbox.get(5)
    with pytest.raises(EOFError):  # and again
        inbox.get(0.0)


def test_an_export_that_fails_is_raised_to_the_loop() -> None:
    front, mine = _pair()
    holder: list[Inbox] = []
    holder.append(Inbox(mine, _Handoff(holder), _Out()))
    front.send(Export("bad", 1))
    with pytest.raises(RuntimeError, match="ValueError: no lease"):
        holder[0].get(5)
    front.close()


def test_stop_ends_the_reading_thread() -> None:
    front, mine = _pair()
    inbox = Inbox(mine, None, _Out())
    front.send(Export("r", 1))  # no KV hand-off: the loop's to refuse
    front.send(Stop())
    assert inbox.get(5) == Export("r", 1)
    assert inbox.get(5) == Stop()
    inbox.thread.join(5)
    assert not inbox.thread.is_alive()
    front.close()
