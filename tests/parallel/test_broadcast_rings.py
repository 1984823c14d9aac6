"""Step metadata through shared-memory rings: every receiver gets every object in order,
and a receiver waiting for its next step notices that the sender's process is gone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshserve.parallel.broadcast import (
    RingBroadcaster,
    RingInbox,
    process_alive,
    watch_process,
)
from meshserve.parallel.shm_allreduce import supported
from meshserve.parallel.shm_ring import ShmRing

pytestmark = pytest.mark.skipif(not supported(), reason="needs x86-64 and /dev/shm")


def ring_pair(slot_bytes: int = 32) -> tuple[ShmRing, ShmRing]:
    path = ShmRing.new_path()
    producer = ShmRing(path, create=True, num_slots=4, slot_bytes=slot_bytes, timeout_s=5.0)
    consumer = ShmRing(path, create=False, num_slots=4, slot_bytes=slot_bytes, timeout_s=5.0)
    producer.unlink()
    return producer, consumer


def test_every_receiver_gets_every_object_in_order() -> None:
    pairs = [ring_pair(), ring_pair()]
    sender = RingBroadcaster([p for p, _ in pairs])
    inboxes = [RingInbox(c, watch_process(1, "init")) for _, c in pairs]
    objects = [{"step": 1, "tokens": list(range(15))}, None]  # 2-3 slots, then one
    try:
        for obj in objects:
            sender.send(obj)
            for inbox in inboxes:
                assert inbox.get() == obj
        assert sender.num_messages == 2
    finally:
        for p, c in pairs:
            p.close()
            c.close()


def test_a_waiting_receiver_raises_once_the_sender_is_gone() -> None:
    producer, consumer = ring_pair()
    sender = subprocess.Popen([sys.executable, "-c", "pass"])
    sender.wait()  # exited and reaped: its pid names no process
    assert not process_alive(sender.pid)
    inbox = RingInbox(consumer, watch_process(sender.pid, "the driver (rank 0)"))
    try:
        with pytest.raises(RuntimeError, match=rf"the driver \(rank 0\) \(pid {sender.pid}\) "
                                               "is gone"):
            inbox.get()
    finally:
        producer.close()
        consumer.close()


def test_a_zombie_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        import time
        deadline = time.monotonic() + 10
        while process_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process_alive(child.pid)  # exited, not yet reaped
    finally:
        child.wait()
