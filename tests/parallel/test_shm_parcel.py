"""Shared-memory parcels: parts read as they are written, sizes checked, bounded waits on
either side, nothing left under SHM_DIR however a transfer ends."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.parallel.comm.shm_allreduce import SHM_DIR, supported
from meshserve.parallel.comm.shm_parcel import ParcelError, ShmParcel, sweep

pytestmark = pytest.mark.skipif(not supported(), reason="needs x86-64 and /dev/shm")


def new_path() -> str:
    return f"{SHM_DIR}/meshserve-kv-test{uuid.uuid4().hex[:12]}-1-0-1"


def left(path: str) -> list[str]:
    return [p for p in (path, f"{path}.new") if os.path.exists(p)]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=6))
def test_every_part_arrives_whole_and_apart_from_the_others(sizes: list[int]) -> None:
    path = new_path()
    sender = ShmParcel.create(path, sizes)
    receiver = ShmParcel.attach(path, sizes, time.monotonic() + 1.0, "test parcel")
    assert left(path) == []  # named only until the receiver has it
    want = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
    for i, w in enumerate(want):
        sender.part(i).copy_(w)
    sender.written(len(sizes))
    assert sender.wait_attached(time.monotonic() + 1.0)
    for i, w in enumerate(want):
        assert torch.equal(receiver.wait_part(i, time.monotonic() + 1.0, "test parcel"), w)
    sender.close()
    receiver.close()


def test_the_receiver_places_each_part_while_later_ones_are_written() -> None:
    sizes = [4096] * 5
    path = new_path()
    seen: list[int] = []

    def send() -> None:
        sender = ShmParcel.create(path, sizes)
        for i in range(len(sizes)):
            sender.part(i).fill_(i + 1)
            sender.written(i + 1)
            while len(seen) <= i and time.monotonic() < deadline:  # the receiver has it
                time.sleep(1e-3)
        assert sender.wait_attached(deadline)
        sender.unlink()
        sender.close()

    deadline = time.monotonic() + 5.0
    thread = threading.Thread(target=send)
    thread.start()
    receiver = ShmParcel.attach(path, sizes, deadline, "test parcel")
    for i in range(len(sizes)):
        assert int(receiver.wait_part(i, deadline, "test parcel").max()) == i + 1
        seen.append(i)
    thread.join()
    receiver.close()
    assert seen == list(range(5)) and left(path) == []


def test_a_parcel_of_another_size_is_refused_naming_both() -> None:
    path = new_path()
    sender = ShmParcel.create(path, [100, 100])
    with pytest.raises(ParcelError, match=r"kv 7: the sender's parcel has 448 bytes, this "
                                          r"side expects 384 \(2 parts\)"):
        ShmParcel.attach(path, [100, 50], time.monotonic() + 1.0, "kv 7")
    sender.unlink()
    sender.close()
    assert left(path) == []


def test_a_sender_that_gives_up_fails_its_receiver_at_once() -> None:
    path = new_path()
    sender = ShmParcel.create(path, [64, 64])
    receiver = ShmParcel.attach(path, [64, 64], time.monotonic() + 30.0, "kv 8")
    sender.written(1)
    sender.abandon()
    receiver.wait_part(0, time.monotonic() + 30.0, "kv 8")
    t0 = time.monotonic()
    with pytest.raises(ParcelError, match="kv 8: the sender gave up"):
        receiver.wait_part(1, time.monotonic() + 30.0, "kv 8")
    assert time.monotonic() - t0 < 5.0
    sender.close()
    receiver.close()


def test_waits_on_a_missing_side_are_bounded() -> None:
    path = new_path()
    t0 = time.monotonic()
    with pytest.raises(ParcelError, match="kv 9: the sender did not begin in time"):
        ShmParcel.attach(path, [64], t0 + 0.3, "kv 9")
    sender = ShmParcel.create(path, [64])
    assert not sender.wait_attached(time.monotonic() + 0.3)  # nobody came
    sender.unlink()
    sender.close()
    receiver_late = pytest.raises(ParcelError, match="did not begin")
    with receiver_late:
        ShmParcel.attach(path, [64], time.monotonic() + 0.1, "kv 9")
    assert time.monotonic() - t0 < 5.0 and left(path) == []


def test_a_part_never_written_times_out() -> None:
    path = new_path()
    sender = ShmParcel.create(path, [64, 64])
    receiver = ShmParcel.attach(path, [64, 64], time.monotonic() + 1.0, "kv 10")
    sender.written(1)
    with pytest.raises(ParcelError, match="kv 10: part 2 of 2 did not come in time"):
        receiver.wait_part(1, time.monotonic() + 0.3, "kv 10")
    sender.close()
    receiver.close()


def test_sweep_removes_what_a_dead_sender_left() -> None:
    prefix = f"meshserve-kv-test{uuid.uuid4().hex[:12]}-"
    for name in ("3-0-1", "4-0-1", "rank0"):
        ShmParcel.create(f"{SHM_DIR}/{prefix}{name}", [64]).close()
    other = new_path()
    ShmParcel.create(other, [64]).close()
    assert sweep(prefix) == 3
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    assert left(other) == [other]  # another run's file stays
    os.unlink(other)
