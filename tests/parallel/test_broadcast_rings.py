"""Step metadata through shared-memory rings: every receiver gets every object in order,
and a receiver waiting for its next step notices that the sender's process is gone."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from meshserve.parallel.comm.broadcast import (
    RingBroadcaster,
    RingInbox,
    process_alive,
    watch_process,
)
from meshserve.parallel.comm.shm_allreduce import supported
from meshserve.parallel.comm.shm_ring import ShmRing

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
        deadline = time.monotonic() + 10
        while process_alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not process_alive(child.pid)  # exited, not yet reaped
    finally:
        child.wait()


def test_a_watch_looks_at_most_once_an_interval() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    check = watch_process(child.pid, "rank 1", interval_s=0.5)
    try:
        check()  # looked: alive
        child.kill()
        child.wait()
        check()  # within the interval: does not look again (cheap in a polling loop)
        time.sleep(0.6)
        with pytest.raises(RuntimeError, match=rf"rank 1 \(pid {child.pid}\) is gone"):
            check()
    finally:
        if child.poll() is None:
            child.kill()


def test_a_sender_waiting_for_room_raises_once_the_receiver_is_gone() -> None:
    """A stage sending to a dead driver through a full ring stops at once, not at the
    ring's timeout (5 s here, parallel.timeout_s in a run)."""
    producer, consumer = ring_pair()
    receiver = subprocess.Popen([sys.executable, "-c", "pass"])
    receiver.wait()
    sender = RingBroadcaster([producer], alive=watch_process(receiver.pid, "the driver"))
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="the driver .* is gone"):
            for step in range(100):  # nobody takes: the ring fills, then the wait begins
                sender.send(step)
        assert time.monotonic() - t0 < 2
    finally:
        producer.close()
        consumer.close()
