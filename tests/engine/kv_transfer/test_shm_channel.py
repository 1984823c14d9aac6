"""Shared-memory channels: every transfer arrives whole whatever its size against the
slots and whatever order the receiver asks in; a transfer never asked for is never
written; either side giving up fails the other in bounded time and leaves the channel
working; nothing is left under SHM_DIR."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.engine.kv_transfer.shm_channel import ChannelError, ShmChannel, sweep
from meshserve.parallel.comm.shm_allreduce import supported
from meshserve.parallel.comm.shm_names import SHM_DIR

pytestmark = pytest.mark.skipif(not supported(), reason="needs x86-64 and /dev/shm")

SLOTS, SLOT_BYTES = 2, 64


def pair() -> tuple[ShmChannel, ShmChannel]:
    path = f"{SHM_DIR}/meshserve-kv-test{uuid.uuid4().hex[:12]}-0-1"
    receiver = ShmChannel.receiver(path, SLOTS, SLOT_BYTES)
    sender = ShmChannel.sender(path, time.monotonic() + 1.0, "test", SLOTS, SLOT_BYTES)
    return receiver, sender


def payload(tid: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(tid)
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]


def filler(parts: list[torch.Tensor]) -> Callable[[int, int, torch.Tensor], None]:
    return lambda i, a, slot: slot.copy_(parts[i][a:a + slot.numel()])


def receive(receiver: ShmChannel, tid: int, sizes: list[int],
            within_s: float = 5.0) -> list[torch.Tensor]:
    got = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    receiver.receive(tid, sizes, time.monotonic() + within_s, f"kv {tid}",
                     lambda i, a, chunk: got[i][a:a + chunk.numel()].copy_(chunk))
    return got


def in_thread(fn: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - checked by the test
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(1, 300), min_size=1, max_size=4), min_size=1,
                max_size=4))
def test_every_transfer_arrives_whole_whatever_its_size(transfers: list[list[int]]) -> None:
    receiver, sender = pair()
    try:
        for tid, sizes in enumerate(transfers, start=1):
            want = payload(tid, sizes)
            t, errors = in_thread(lambda: sender.send(
                tid, sizes, time.monotonic() + 5.0, "kv", filler(want)))  # noqa: B023
            got = receive(receiver, tid, sizes)
            t.join()
            assert not errors and all(torch.equal(g, w) for g, w in zip(got, want))
            assert not os.path.exists(receiver.path)  # its name went once both had it
    finally:
        receiver.close()
        sender.close()


def test_the_receiver_picks_the_order() -> None:
    receiver, sender = pair()
    sizes = [200, 90]
    threads = [in_thread(lambda tid=tid: sender.send(tid, sizes, time.monotonic() + 5.0, "kv",
                                                     filler(payload(tid, sizes))))
               for tid in (1, 2, 3)]
    for tid in (3, 1, 2):
        got = receive(receiver, tid, sizes)
        assert all(torch.equal(g, w) for g, w in zip(got, payload(tid, sizes)))
    for t, errors in threads:
        t.join()
        assert not errors
    receiver.close()
    sender.close()


def test_a_transfer_never_asked_for_is_never_written() -> None:
    receiver, sender = pair()
    touched: list[int] = []
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="kv 7: never asked for: timed out"):
        sender.send(7, [100], t0 + 0.3, "kv 7", lambda *_: touched.append(1))
    assert not touched and time.monotonic() - t0 < 3.0
    t, errors = in_thread(lambda: sender.send(8, [100], time.monotonic() + 5.0, "kv",
                                              filler(payload(8, [100]))))
    assert torch.equal(receive(receiver, 8, [100])[0], payload(8, [100])[0])
    t.join()
    assert not errors
    receiver.close()
    sender.close()


def test_a_receiver_that_gives_up_stops_its_sender_and_the_next_transfer_is_whole() -> None:
    receiver, sender = pair()
    sizes = [SLOT_BYTES * 6]

    def slow(i: int, a: int, slot: torch.Tensor) -> None:
        time.sleep(0.1)
        slot.fill_(1)

    t, errors = in_thread(lambda: sender.send(1, sizes, time.monotonic() + 10.0, "kv 1", slow))
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="kv 1: chunk"):
        receive(receiver, 1, sizes, within_s=0.25)
    t.join(5.0)
    assert not t.is_alive() and time.monotonic() - t0 < 5.0
    assert len(errors) == 1 and "kv 1: the receiver gave up" in str(errors[0])
    want = payload(2, [150, 70])
    t, errors = in_thread(lambda: sender.send(2, [150, 70], time.monotonic() + 5.0, "kv",
                                              filler(want)))
    got = receive(receiver, 2, [150, 70])
    t.join()
    assert not errors and all(torch.equal(g, w) for g, w in zip(got, want))
    receiver.close()
    sender.close()


def test_a_sender_that_gives_up_fails_its_receiver_at_once() -> None:
    receiver, sender = pair()

    def broken(i: int, a: int, slot: torch.Tensor) -> None:
        if a > 0:
            raise RuntimeError("packing failed")
        slot.fill_(2)

    t, errors = in_thread(lambda: sender.send(1, [SLOT_BYTES * 3], time.monotonic() + 10.0,
                                              "kv 1", broken))
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="kv 1: the sender gave up"):
        receive(receiver, 1, [SLOT_BYTES * 3], within_s=30.0)
    t.join()
    assert time.monotonic() - t0 < 5.0 and "packing failed" in str(errors[0])
    receiver.close()
    sender.close()


def test_a_sender_waits_for_a_missing_receiver_in_bounded_time() -> None:
    path = f"{SHM_DIR}/meshserve-kv-test{uuid.uuid4().hex[:12]}-0-1"
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="kv 3: the receiver's channel .* did not appear"):
        ShmChannel.sender(path, t0 + 0.3, "kv 3", SLOTS, SLOT_BYTES)
    assert time.monotonic() - t0 < 3.0


def test_sweep_removes_a_run_s_files_and_only_them() -> None:
    prefix = f"meshserve-kv-test{uuid.uuid4().hex[:12]}-"
    for name in ("0-1", "1-0", "rank0"):
        ShmChannel.receiver(f"{SHM_DIR}/{prefix}{name}", SLOTS, SLOT_BYTES).close()
    other = ShmChannel.receiver(f"{SHM_DIR}/meshserve-kv-test{uuid.uuid4().hex[:12]}-0-1",
                                SLOTS, SLOT_BYTES)
    assert sweep(prefix) == 3
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    assert os.path.exists(other.path)
    other.unlink()
    other.close()
