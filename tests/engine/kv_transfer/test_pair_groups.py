"""Pair groups: the generations a pair moves through as its transfers fail, and real gloo
groups of one pair (two threads of one process) carrying messages in the order both sides
issue them, a retired one replaced by the next generation's."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from meshserve.engine.kv_transfer.pair_groups import PairGroups


def never_opened() -> dist.Store:
    raise AssertionError("no group is made here")


def test_a_failed_generation_is_left_once_and_older_messages_are_dropped() -> None:
    pairs = PairGroups(never_opened, 3, "gloo", 1.0)
    assert pairs.generation(0, 3) == 0
    pairs.retire(0, 3, 0)
    pairs.retire(0, 3, 0)  # a second transfer of the same generation failing
    assert pairs.generation(0, 3) == 1 and pairs.retirements == 1
    assert pairs.generation(1, 3) == 0  # other pairs are untouched
    assert not pairs.adopt(0, 3, 0)  # an ask of the retired generation: dropped
    assert pairs.adopt(0, 3, 1)
    assert pairs.adopt(0, 3, 4) and pairs.generation(0, 3) == 4  # the peer moved on
    assert pairs.retirements == 1  # (adopting is not failing)


def test_bad_backend_names_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"'mpi'.*allowed: \('gloo', 'nccl'\)"):
        PairGroups(never_opened, 0, "mpi", 1.0)


def test_messages_of_a_pair_arrive_in_order_and_a_retired_pair_starts_afresh(
        open_store: Callable[[], dist.Store]) -> None:
    src, dst = PairGroups(open_store, 0, "gloo", 2.0), PairGroups(open_store, 1, "gloo", 2.0)
    got: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def send(gen: int, values: list[float]) -> None:
        try:
            group = src.group(0, 1, gen)
            works = [group.send([torch.full((4,), v)], 1, 0) for v in values]
            for w in works:
                src.wait(w, time.monotonic() + 10)
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread
            errors.append(e)

    def receive(gen: int, n: int) -> None:
        group = dst.group(0, 1, gen)
        bufs = [torch.empty(4) for _ in range(n)]
        works = [group.recv([b], 0, 0) for b in bufs]
        for w in works:
            dst.wait(w, time.monotonic() + 10)
        got.extend(bufs)

    sender = threading.Thread(target=send, args=(0, [1.0, 2.0, 3.0]))
    sender.start()
    receive(0, 3)
    sender.join()
    assert [float(b[0]) for b in got] == [1.0, 2.0, 3.0] and not errors

    # the receiver gives up on a message that never comes: the pair's next group
    group = dst.group(0, 1, 0)
    work = group.recv([torch.empty(4)], 0, 0)
    with pytest.raises(RuntimeError):
        dst.wait(work, time.monotonic() + 0.2)
    dst.retire(0, 1, 0)
    gen = dst.generation(0, 1)
    assert gen == 1 and src.adopt(0, 1, gen)
    got.clear()
    sender = threading.Thread(target=send, args=(gen, [7.0, 8.0]))
    sender.start()
    receive(gen, 2)
    sender.join()
    assert [float(b[0]) for b in got] == [7.0, 8.0] and not errors
    with pytest.raises(RuntimeError, match="retired"):  # too late for the old one
        src.group(0, 1, 0)
    src.close()
    dst.close()
