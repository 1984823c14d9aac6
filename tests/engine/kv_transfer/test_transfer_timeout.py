"""A NIXL READ past its timeout: cancelled through NIXL before the read fails, or waited
for where NIXL cannot cancel it, and reported as still active (its destination blocks
kept out of use) where it neither ends nor cancels. A fake agent plays the slow READ."""

from __future__ import annotations

import threading

import pytest

from meshserve.engine.core.block_manager import BlockManager
from meshserve.engine.kv_transfer import nixl_agent
from meshserve.engine.kv_transfer.connector import ReadStillActive
from meshserve.engine.kv_transfer.nixl_agent import await_transfer


class SlowRead:
    """A transfer that stays PROC for `proc_polls` state checks (None: forever), then
    ends in `end`; `cancellable`: whether releasing it while PROC cancels it."""

    def __init__(self, proc_polls: int | None, end: str = "DONE",
                 cancellable: bool = True) -> None:
        self.proc_polls, self.end, self.cancellable = proc_polls, end, cancellable
        self.polls = 0
        self.released = 0
        self.cancelled = False

    def state(self) -> str:
        if self.cancelled or (self.proc_polls is not None and self.polls >= self.proc_polls):
            return self.end if not self.cancelled else "ERR"
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        self.polls += 1
        return self.state()

    def release_xfer_handle(self, handle: object) -> None:
        if self.state() == "PROC":
            if not self.cancellable:
                raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
            self.cancelled = True
        self.released += 1


class Clock:
    """Each reading a tenth of a second later."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 0.1
        return self.t


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_agent.time, "sleep", lambda s: None)


def wait(agent: SlowRead, timeout_s: float = 1.0) -> None:
    await_transfer(agent, object(), "PROC", timeout_s, threading.Lock(), "a read", Clock())


def test_a_read_that_lands_in_time_is_released_once() -> None:
    agent = SlowRead(proc_polls=3)
    wait(agent)
    assert agent.released == 1 and not agent.cancelled


def test_a_failed_read_is_released_and_named() -> None:
    agent = SlowRead(proc_polls=2, end="ERR")
    with pytest.raises(RuntimeError, match=r"a read failed \(ERR\)"):
        wait(agent)
    assert agent.released == 1


def test_a_slow_read_is_cancelled_through_nixl_before_it_fails() -> None:
    agent = SlowRead(proc_polls=None)
    with pytest.raises(RuntimeError, match=r"took over 1.0 s \(cancelled\)") as e:
        wait(agent)
    assert not isinstance(e.value, ReadStillActive)
    assert agent.cancelled and agent.released == 1


def test_a_read_nixl_cannot_cancel_is_waited_for_then_released() -> None:
    agent = SlowRead(proc_polls=15, cancellable=False)  # ends within the grace period
    with pytest.raises(RuntimeError, match="took over") as e:
        wait(agent)
    assert not isinstance(e.value, ReadStillActive)
    assert agent.released == 1 and agent.polls >= 15


def test_a_read_that_neither_ends_nor_cancels_is_reported_still_active() -> None:
    agent = SlowRead(proc_polls=None, cancellable=False)
    with pytest.raises(ReadStillActive, match="kept out of use"):
        wait(agent)
    assert agent.released == 0  # the handle stays: the READ may still write


def test_blocks_a_read_may_still_write_are_never_freed() -> None:
    bm = BlockManager(8, 4)
    prompt = list(range(13))
    imp = bm.begin_import(prompt, tail=True)
    assert imp is not None and imp.blocks and imp.tail is not None
    fresh = len(imp.blocks) + 1
    assert bm.finish_import(imp, written=False, keep_out=True) is None
    assert bm.num_kept_out == fresh and bm.num_free_blocks == 8 - fresh
    again = bm.begin_import(prompt, tail=True)  # a later import takes other blocks
    assert again is not None
    bm.finish_import(again, written=False)
    assert bm.num_free_blocks == 8 - fresh
