"""Waiting on another process through shared memory: poll, yield, then back off.

Both shared-memory mechanisms (shm_allreduce, shm_ring) wait the same way: a waiting rank
polls a flag it shares with another process, yields the core now and then, and after a
while sleeps between polls, since with more ranks than cores a spinning rank would take
the core from the rank it waits for.
"""

from __future__ import annotations

import time
from collections.abc import Callable

SPINS_BEFORE_YIELD = 64
"""Polls between yields of the core (and between checks of the deadline and `on_check`)."""

SPINS_BEFORE_SLEEP = 1024
"""Polls after which the waiter sleeps BACKOFF_S between polls."""

BACKOFF_S = 50e-6

IDLE_AFTER_S = 0.5
"""A wait this long is an idle one (a worker between requests, a stage behind a long
prefill): from then on the waiter sleeps IDLE_BACKOFF_S between polls, so an idle rank
costs next to no CPU and answers within a millisecond."""

IDLE_BACKOFF_S = 1e-3


def spin_until(ready: Callable[[], bool], timeout_s: float | None,
               on_check: Callable[[], None] = lambda: None) -> bool:
    """Poll `ready` until it holds (True) or `timeout_s` passes (False; None: no limit).
    `on_check` runs every SPINS_BEFORE_YIELD polls and may raise to give up."""
    if ready():
        return True
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    idle_at = start + IDLE_AFTER_S
    backoff = BACKOFF_S
    spins = 0
    while not ready():
        spins += 1
        if spins > SPINS_BEFORE_SLEEP:
            time.sleep(backoff)
        elif spins % SPINS_BEFORE_YIELD == 0:
            time.sleep(0)
        if spins % SPINS_BEFORE_YIELD == 0:
            on_check()
            now = time.monotonic()
            if deadline is not None and now > deadline:
                return False
            if now > idle_at:
                backoff = IDLE_BACKOFF_S
    return True
