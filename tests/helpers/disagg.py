"""Driving a disaggregated engine in tests: step until a condition, kill a replica."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from meshserve.engine.disagg import DisaggEngine
from meshserve.engine.outputs import RequestOutput


def run_until(engine: DisaggEngine, done: Callable[[list[RequestOutput]], bool],
              timeout_s: float = 60.0) -> list[RequestOutput]:
    """Step the front until `done(outputs so far)`; those outputs."""
    outs: list[RequestOutput] = []
    deadline = time.monotonic() + timeout_s
    while not done(outs):
        assert time.monotonic() < deadline, "timed out"
        outs += engine.step()
    return outs


def kill_replica(engine: DisaggEngine, index: int) -> None:
    """SIGKILL replica `index` (one in a process of its own)."""
    victim = engine._remotes[index]
    assert victim.index == index and victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGKILL)
