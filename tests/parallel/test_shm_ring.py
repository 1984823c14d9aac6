"""The shared-memory ring: FIFO under any interleaving of puts and takes, bounded waits."""

from __future__ import annotations

import os
import threading
import time
from collections import deque

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.parallel.comm.shm_allreduce import supported
from meshserve.parallel.comm.shm_ring import RingTimeout, ShmRing

pytestmark = pytest.mark.skipif(not supported(), reason="needs x86-64 and /dev/shm")


def pair(num_slots: int, slot_bytes: int, timeout_s: float = 1.0) -> tuple[ShmRing, ShmRing]:
    path = ShmRing.new_path()
    producer = ShmRing(path, create=True, num_slots=num_slots, slot_bytes=slot_bytes,
                       timeout_s=timeout_s, what="test ring")
    consumer = ShmRing(path, create=False, num_slots=num_slots, slot_bytes=slot_bytes,
                       timeout_s=timeout_s, what="test ring")
    producer.unlink()
    return producer, consumer


@settings(max_examples=60, deadline=None)
@given(num_slots=st.integers(1, 4),
       ops=st.lists(st.one_of(st.just("take"), st.integers(0, 64), st.integers(-9, -1)),
                    max_size=40))
def test_messages_arrive_in_order_whatever_the_interleaving(num_slots: int,
                                                            ops: list[object]) -> None:
    """ints >= 0: put that many float32 values; < 0: put a marker; "take": take one."""
    producer, consumer = pair(num_slots, slot_bytes=64 * 4)
    sent: deque[tuple[int, torch.Tensor | None]] = deque()
    try:
        for i, op in enumerate(ops):
            if op == "take" or len(sent) == num_slots:  # a full ring: take before putting
                if sent:
                    length, expected = sent.popleft()
                    if expected is None:
                        assert consumer.take_bytes() == (length, b"")
                    else:
                        out = torch.empty_like(expected)
                        consumer.take_into(out)
                        assert torch.equal(out, expected)
                if op == "take":
                    continue
            assert isinstance(op, int)
            if op < 0:
                producer.put([], length=op)
                sent.append((op, None))
            else:
                x = torch.arange(op, dtype=torch.float32) + i
                producer.put([x[: op // 2], x[op // 2:]])  # parts land back to back
                sent.append((4 * op, x))
        while sent:
            length, expected = sent.popleft()
            got_length, data = consumer.take_bytes()
            assert got_length == length
            if expected is not None:
                assert data == expected.numpy().tobytes()
        producer.drain()  # everything taken: returns at once
    finally:
        producer.close()
        consumer.close()


def test_a_full_ring_waits_for_the_consumer_and_a_silent_one_times_out() -> None:
    producer, consumer = pair(num_slots=2, slot_bytes=16, timeout_s=0.5)
    try:
        producer.put_bytes(b"a")
        producer.put_bytes(b"bb")

        def take_later() -> None:
            time.sleep(0.1)
            assert consumer.take_bytes() == (1, b"a")

        t = threading.Thread(target=take_later)
        t0 = time.monotonic()
        t.start()
        producer.put_bytes(b"ccc")  # waits until the first message is taken
        t.join()
        assert time.monotonic() - t0 >= 0.09
        assert [consumer.take_bytes() for _ in range(2)] == [(2, b"bb"), (3, b"ccc")]
        with pytest.raises(RingTimeout, match=r"test ring: the other side did not post "
                                               r"message #3 within 0.5 s"):
            consumer.take_bytes()
        with pytest.raises(RingTimeout, match="did not take"):
            for _ in range(3):
                producer.put_bytes(b"x")
        with pytest.raises(RuntimeError, match="has 1 bytes, the receiver expected 8"):
            consumer.take_into(torch.empty(2, dtype=torch.float32))
    finally:
        producer.close()
        consumer.close()


def test_alive_is_asked_while_waiting_and_can_give_up() -> None:
    producer, consumer = pair(num_slots=1, slot_bytes=8, timeout_s=None)

    def dead() -> None:
        raise RuntimeError("rank 1 was killed by SIGKILL")

    try:
        with pytest.raises(RuntimeError, match="SIGKILL"):
            consumer.take_bytes(alive=dead)
    finally:
        producer.close()
        consumer.close()
    assert not os.path.exists(producer.path)


def test_a_full_shm_raises_at_creation_and_leaves_no_file(monkeypatch) -> None:
    """posix_fallocate reserves the pages up front: no room fails here, not with SIGBUS at
    the first write (connect_rings then leaves that ring to gloo)."""
    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    path = ShmRing.new_path()
    with pytest.raises(OSError, match="No space"):
        ShmRing(path, create=True, num_slots=2, slot_bytes=64)
    assert not os.path.exists(path)


@settings(max_examples=40, deadline=None)
@given(num_slots=st.integers(1, 3), slot_bytes=st.integers(1, 9),
       sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8))
def test_messages_longer_than_a_slot_arrive_whole_and_in_order(
        num_slots: int, slot_bytes: int, sizes: list[int]) -> None:
    """put_message spreads a message over slots, waiting for the consumer whenever the ring
    is full; take_message joins it again."""
    producer, consumer = pair(num_slots, slot_bytes, timeout_s=5.0)
    messages = [bytes((i * 7 + j) % 256 for j in range(n)) for i, n in enumerate(sizes)]
    got: list[bytes] = []
    try:
        t = threading.Thread(target=lambda: got.extend(consumer.take_message()
                                                       for _ in messages))
        t.start()
        for m in messages:
            producer.put_message(m)
        t.join(10)
        assert got == messages
    finally:
        producer.close()
        consumer.close()


def test_an_idle_wait_for_a_message_outlasts_the_ring_timeout() -> None:
    producer, consumer = pair(num_slots=2, slot_bytes=4, timeout_s=0.05)

    def post_later() -> None:
        time.sleep(0.2)
        producer.put_message(b"step 1")  # two slots

    try:
        t = threading.Thread(target=post_later)
        t.start()
        assert consumer.take_message(idle=True) == b"step 1"  # a rank between steps
        t.join()
        with pytest.raises(RingTimeout, match="did not post message #2 within 0.05 s"):
            consumer.take_message()
    finally:
        producer.close()
        consumer.close()
