"""Tail terms of the closed forms: the share of requests that meet an SLO, where the mean
request's figures say only whether the average one does.

Two effects set a steady service's tails under Poisson arrivals (DistServe's attainment:
the share of requests within both SLOs):
  - a prompt waits behind those queued before it: an M/D/c queue of prefills, one for
    the replicas a router feeds (`wait_within`, `mean_wait_s`);
  - a decoding request is stalled by every prompt its replica prefills before it ends:
    those that arrive while it runs (and while its own prompt ran), and those that arrive
    during their prefills, recursively, the total count of a busy period
    (`stalls_within`).
"""

from __future__ import annotations

import math


def wait_within(t: float, rate: float, service_s: float, servers: int = 1) -> float:
    """P(wait <= t) of a Poisson arrival at `rate` into a FIFO queue of `servers` serving
    each in `service_s` (M/D/c; replicas behind a router that sends each prompt to the
    least loaded one share one queue). One server: Erlang's exact sum while it is well
    conditioned (rate x t <= EXACT_WAIT). Beyond it, and for several servers: a wait with
    probability Erlang's C (M/M/c's), then exponential with half M/M/c's mean (a fixed
    service halves it: Allen-Cunneen), service_s / (2 c (1 - load)); for one server that
    is the M/D/1 queue's mean wait. 0 when saturated."""
    load = rate * service_s / servers
    if t < 0 or load >= 1:
        return 0.0
    if load <= 0:
        return 1.0
    if servers > 1 or rate * t > EXACT_WAIT:
        waits = erlang_c(servers, rate * service_s)
        return 1.0 - waits * math.exp(-2.0 * servers * (1.0 - load) * t / service_s)
    total = 0.0
    for k in range(min(math.floor(t / service_s), WAIT_TERMS) + 1):
        x = rate * (k * service_s - t)  # <= 0: the terms alternate
        if x == 0:
            total += float(k == 0)
        else:
            total += (-1) ** k * math.exp(k * math.log(-x) - math.lgamma(k + 1) - x)
    return min(1.0, max(0.0, (1.0 - load) * total))


EXACT_WAIT = 10.0
"""Arrivals per wait (rate x t) up to which wait_within sums Erlang's alternating series
(its terms reach e^(2 rate t), so float64 keeps about 7 digits there)."""
WAIT_TERMS = 80
"""Terms of Erlang's series summed at most: past them each is below EXACT_WAIT^k / k!."""


def mean_wait_s(rate: float, service_s: float, servers: int = 1) -> float:
    """The mean wait in the queue wait_within describes: Erlang's C times the exponential
    tail's mean, service_s / (2 c (1 - load)); for one server the M/D/1 queue's exact mean
    wait, load x service / (2 (1 - load)). inf when saturated."""
    load = rate * service_s / servers
    if load >= 1:
        return math.inf
    if load <= 0:
        return 0.0
    return erlang_c(servers, rate * service_s) * service_s / (2 * servers * (1 - load))


def erlang_c(servers: int, offered: float) -> float:
    """P(an arrival waits) in an M/M/c queue of `servers` at `offered` = rate x service
    (Erlang's C formula); 1 when saturated."""
    load = offered / servers
    if load >= 1:
        return 1.0
    term, below = 1.0, 0.0
    for k in range(servers):
        below += term
        term *= offered / (k + 1)
    full = term / (1.0 - load)
    return full / (below + full)


def busy_period_pmf(n: int, k: int, load: float) -> float:
    """P(a queue that starts with `k` customers serves `n` before it empties), arrivals
    per service time Poisson with mean `load` (the Borel-Tanner law)."""
    if k == 0:
        return float(n == 0)
    if n < k:
        return 0.0
    if load <= 0:
        return float(n == k)
    log = math.log(k / n) - load * n + (n - k) * math.log(load * n) - math.lgamma(n - k + 1)
    return math.exp(log)


def stalls_within(x: float, initial_mean: float, load: float) -> float:
    """P(N <= x), N the prompts prefilled while a request decodes: Poisson(`initial_mean`)
    of them start it (those arriving while it decodes and while its own prompt ran), and
    each prefill's arrivals (Poisson, mean `load` = rate x prefill time) join, so N is the
    count of a busy period started by them: a compound Poisson count of busy periods
    started by one (Borel), summed by Panjer's recursion. Linear between integers, so that
    x may be a real budget of prefills; 0 for load >= 1 (the prompts never end). Where
    the count runs past EXACT_STALLS, a normal law of its mean and variance stands in."""
    if x < 0 or load >= 1:
        return 0.0
    if initial_mean <= 0:
        return 1.0
    mean = initial_mean / (1 - load)
    sd = math.sqrt(initial_mean / (1 - load) ** 3)
    if x >= mean + TAIL_SDS * sd:
        return 1.0
    if mean + TAIL_SDS * sd > EXACT_STALLS:
        return 0.5 * math.erfc(-(x + 0.5 - mean) / (sd * math.sqrt(2)))
    whole = math.floor(x)
    pmf = _stalls_pmf(whole + 1, initial_mean, load)
    below = sum(pmf[:whole + 1])
    return min(1.0, below + (x - whole) * pmf[whole + 1])


TAIL_SDS = 12.0
"""Past this many standard deviations above its mean, a count of stalls is taken as sure."""
EXACT_STALLS = 200
"""The largest count stalls_within sums exactly (Panjer's recursion is quadratic in it)."""


def _stalls_pmf(n_max: int, initial_mean: float, load: float) -> list[float]:
    """P(N = n) for n <= n_max (Panjer: g(n) = m/n sum_j j f(j) g(n - j), f Borel)."""
    jf = [j * busy_period_pmf(j, 1, load) for j in range(n_max + 1)]
    g = [math.exp(-initial_mean)]
    for n in range(1, n_max + 1):
        g.append(initial_mean / n * sum(jf[j] * g[n - j] for j in range(1, n + 1)))
    return g
