"""The closed forms' tail terms: M/D/1 waits and the prompts that stall a decode."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.parallel.planner.tails import (
    busy_period_pmf,
    erlang_c,
    mean_wait_s,
    stalls_within,
    wait_within,
)


def _md1_waits(rate: float, service: float, n: int, seed: int = 0) -> list[float]:
    """Waits of n Poisson arrivals in a FIFO queue with fixed service (Lindley)."""
    rng, wait, out = random.Random(seed), 0.0, []
    for _ in range(n):
        gap = rng.expovariate(rate)
        wait = max(0.0, wait + service - gap)
        out.append(wait)
    return out


@pytest.mark.parametrize("load", [0.3, 0.6, 0.8])
def test_wait_within_matches_a_simulated_queue(load: float) -> None:
    waits = _md1_waits(load, 1.0, 200_000)
    for t in (0.0, 0.5, 2.0, 5.0):
        empirical = sum(w <= t for w in waits) / len(waits)
        assert wait_within(t, load, 1.0) == pytest.approx(empirical, abs=0.04)


def test_wait_within_edges() -> None:
    assert wait_within(1.0, 1.0, 1.0) == 0.0  # saturated
    assert wait_within(-0.1, 0.5, 1.0) == 0.0
    assert wait_within(0.0, 0.0, 1.0) == 1.0  # nobody ahead


@given(st.integers(1, 6), st.floats(0.0, 0.8))
@settings(max_examples=40, deadline=None)
def test_a_busy_period_s_count_sums_to_one_with_its_known_mean(k: int, load: float) -> None:
    pmf = [busy_period_pmf(n, k, load) for n in range(2000)]
    assert sum(pmf) == pytest.approx(1.0, abs=1e-6)
    assert sum(n * p for n, p in enumerate(pmf)) == pytest.approx(k / (1 - load), rel=1e-3)


def _stalls(initial: float, load: float, n: int, seed: int = 1) -> list[int]:
    """Poisson(initial) prompts, each prefill's Poisson(load) arrivals joining, counted."""
    rng = random.Random(seed)

    def poisson(m: float) -> int:
        k, t = 0, rng.expovariate(1.0)
        while t < m:
            k, t = k + 1, t + rng.expovariate(1.0)
        return k

    out = []
    for _ in range(n):
        todo = total = poisson(initial)
        while todo:
            todo -= 1
            more = poisson(load)
            todo, total = todo + more, total + more
        out.append(total)
    return out


@pytest.mark.parametrize(("initial", "load"), [(0.5, 0.2), (1.5, 0.4), (40.0, 0.3)])
def test_stalls_within_matches_sampled_busy_periods(initial: float, load: float) -> None:
    counts = _stalls(initial, load, 20_000)
    mean = initial / (1 - load)
    for x in (math.floor(mean), math.floor(mean) + 2, math.floor(mean * 1.5) + 1):
        empirical = sum(c <= x for c in counts) / len(counts)
        assert stalls_within(x, initial, load) == pytest.approx(empirical, abs=0.03)


def test_stalls_within_is_monotone_between_integers() -> None:
    xs = [i / 4 for i in range(0, 24)]
    ps = [stalls_within(x, 1.2, 0.3) for x in xs]
    assert ps == sorted(ps) and ps[0] == pytest.approx(math.exp(-1.2))
    assert stalls_within(-0.5, 1.2, 0.3) == 0.0 and stalls_within(3.0, 0.0, 0.3) == 1.0


def _mdc_waits(rate: float, service: float, servers: int, n: int, seed: int = 0
               ) -> list[float]:
    """Waits in a FIFO queue of `servers` (Kiefer-Wolfowitz: each server's time to free)."""
    rng, free, out = random.Random(seed), [0.0] * servers, []
    for _ in range(n):
        gap = rng.expovariate(rate)
        free = sorted(max(0.0, f - gap) for f in free)
        out.append(free[0])
        free[0] += service
    return out


@pytest.mark.parametrize(("servers", "load"), [(2, 0.6), (2, 0.85), (4, 0.8)])
def test_wait_within_pools_replicas_into_one_queue(servers: int, load: float) -> None:
    rate = load * servers
    waits = _mdc_waits(rate, 1.0, servers, 200_000)
    for t in (0.0, 0.5, 1.0, 3.0):
        empirical = sum(w <= t for w in waits) / len(waits)
        assert wait_within(t, rate, 1.0, servers) == pytest.approx(empirical, abs=0.05)
    # one queue for two replicas waits less than two queues split at random
    assert wait_within(1.0, rate, 1.0, servers) > wait_within(1.0, load, 1.0)


def test_erlang_c_edges() -> None:
    assert erlang_c(1, 0.7) == pytest.approx(0.7)  # one server: busy with probability load
    assert erlang_c(3, 3.0) == 1.0 and erlang_c(2, 0.0) == 0.0


def test_stalls_within_takes_a_normal_law_for_large_counts() -> None:
    counts = _stalls(150.0, 0.3, 4000)
    for x in (200, 214, 230):
        empirical = sum(c <= x for c in counts) / len(counts)
        assert stalls_within(x, 150.0, 0.3) == pytest.approx(empirical, abs=0.04)


@pytest.mark.parametrize(("servers", "load"), [(1, 0.5), (1, 0.8), (2, 0.7), (4, 0.8)])
def test_mean_wait_matches_a_simulated_queue(servers: int, load: float) -> None:
    waits = _mdc_waits(load * servers, 1.0, servers, 200_000)
    exact = sum(waits) / len(waits)
    assert mean_wait_s(load * servers, 1.0, servers) == pytest.approx(exact, rel=0.15)


def test_mean_wait_edges() -> None:
    assert mean_wait_s(0.5, 1.0) == pytest.approx(0.5 / (2 * 0.5))  # M/D/1: ρS / 2(1-ρ)
    assert mean_wait_s(1.0, 1.0) == math.inf and mean_wait_s(0.0, 1.0) == 0.0
