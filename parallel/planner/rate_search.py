"""The search for the highest arrival rate a layout serves: the simulation's goodput, a
benchmark's measured capacity, and the closed forms' goodput all bisect for it."""

from __future__ import annotations

import math
from collections.abc import Callable


def max_rate(served: Callable[[float], bool], guess: float, rel_tol: float = 0.05,
             floor: float = 1e-3) -> float:
    """The highest rate at which `served(rate)` holds, to within `rel_tol`, for a predicate
    that holds below some rate and not above it: from `guess`, doubling (or halving) until
    a served and an unserved rate bracket it, then bisecting their ratio. 0 when no rate
    down to `floor` x `guess` (the first halving below it) is served; the first doubling
    at or above `guess` / `floor` when every rate up to there is."""
    if guess <= 0 or rel_tol <= 0:
        raise ValueError(f"guess={guess}, rel_tol={rel_tol}: allowed are values > 0")
    lo, hi, rate = 0.0, math.inf, guess
    while True:
        if served(rate):
            lo = rate
        else:
            hi = rate
        if hi == math.inf:
            if lo >= guess / floor:
                return lo
            rate = 2 * lo
        elif lo == 0.0:
            if hi <= floor * guess:
                return 0.0
            rate = hi / 2
        elif hi / lo <= 1 + rel_tol:
            return lo
        else:
            rate = math.sqrt(lo * hi)
