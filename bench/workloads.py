"""The benchmark workloads (docs/benchmarks/README.md) as seeded request lists (prompt token ids + max_new_tokens)."""

from __future__ import annotations

import inspect
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    prompt_token_ids: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0
    """Arrival time after the start of the run (0 = all at once)."""


def longtail(vocab_size: int, seed: int = 0, n: int = 64) -> list[BenchRequest]:
    """Prompts 32..512 tokens; outputs 70% 8..64, 30% 128..256 (very uneven lengths)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        plen = rng.randint(32, 512)
        out = rng.randint(8, 64) if rng.random() < 0.7 else rng.randint(128, 256)
        reqs.append(BenchRequest(_ids(rng, plen, vocab_size), out))
    return reqs


def shared_prefix(vocab_size: int, seed: int = 0, n: int = 32) -> list[BenchRequest]:
    """One 384-token prefix + 16..64 unique tokens, 32 new tokens each."""
    rng = random.Random(seed)
    prefix = _ids(rng, 384, vocab_size)
    return [BenchRequest(prefix + _ids(rng, rng.randint(16, 64), vocab_size), 32)
            for _ in range(n)]


def multi_tenant(vocab_size: int, seed: int = 0, n: int = 256,
                 tenants: int = 8) -> list[BenchRequest]:
    """`tenants` system prompts of 300..600 tokens; `n` questions of 16..64 tokens, each
    after a tenant drawn at random (so tenants arrive interleaved), 16 new tokens each."""
    rng = random.Random(seed)
    systems = [_ids(rng, rng.randint(300, 600), vocab_size) for _ in range(tenants)]
    return [BenchRequest(systems[rng.randrange(tenants)]
                         + _ids(rng, rng.randint(16, 64), vocab_size), 16) for _ in range(n)]


def latency(vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """One request: 256-token prompt, 128 new tokens."""
    return [BenchRequest(_ids(random.Random(seed), 256, vocab_size), 128)]


def short(vocab_size: int, seed: int = 0, n: int = 16) -> list[BenchRequest]:
    """Prompts 32..128 tokens, 16..64 new tokens (the batch for the big model)."""
    rng = random.Random(seed)
    return [BenchRequest(_ids(rng, rng.randint(32, 128), vocab_size), rng.randint(16, 64))
            for _ in range(n)]


def rag(vocab_size: int, seed: int = 0, n: int = 48) -> list[BenchRequest]:
    """Retrieval-augmented prompts of 1000..2000 tokens (no shared prefix), 64..256 new
    tokens each: prefill-heavy, the workload disaggregation is for."""
    rng = random.Random(seed)
    return [BenchRequest(_ids(rng, rng.randint(1000, 2000), vocab_size), rng.randint(64, 256))
            for _ in range(n)]


def poisson(reqs: list[BenchRequest], rate: float, seed: int = 0) -> list[BenchRequest]:
    """The same requests arriving as a Poisson process of `rate` requests/s."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for r in reqs:
        t += rng.expovariate(rate)
        out.append(BenchRequest(r.prompt_token_ids, r.max_new_tokens, t))
    return out


WORKLOADS = {"longtail": longtail, "shared-prefix": shared_prefix, "latency": latency,
             "short": short, "multi-tenant": multi_tenant, "rag": rag}

ONLINE = "online"
"""The longtail requests arriving as a Poisson process (needs a rate)."""


def make(name: str, vocab_size: int, seed: int = 0, n: int | None = None
         ) -> list[BenchRequest]:
    """A named workload: `n` requests where it draws them (its default count without `n`;
    the first requests do not depend on `n`), else its fixed set. ValueError lists the
    names."""
    if name not in WORKLOADS:
        raise ValueError(f"bench.workload={name!r} is invalid: allowed is one of "
                         f"{sorted([*WORKLOADS, ONLINE])} or a JSON workload file")
    make_one = WORKLOADS[name]
    if n is not None and "n" in inspect.signature(make_one).parameters:
        return make_one(vocab_size, seed, n=n)
    return make_one(vocab_size, seed)


def resolve(spec: str, vocab_size: int, *, seed: int = 0, num_requests: int | None = None,
            rate: float | None = None) -> list[BenchRequest]:
    """`spec` (a workload name, 'online' or a JSON file) as validated requests.

    `num_requests`: that many requests, drawn where the workload draws them, else the
    first N of its fixed set or file (ValueError where it holds fewer); `rate`
    (requests/s) makes arrivals a Poisson process.
    """
    if spec == ONLINE:
        if rate is None:
            raise ValueError("bench.workload='online' needs bench.rate: allowed is a rate in "
                             "requests/s, e.g. bench.rate=2.0")
        reqs = make("longtail", vocab_size, seed, num_requests)
    elif spec in WORKLOADS:
        reqs = make(spec, vocab_size, seed, num_requests)
    elif spec.endswith(".json") or Path(spec).expanduser().is_file():
        reqs = load(Path(spec).expanduser())
    else:
        reqs = make(spec, vocab_size, seed)  # raises, listing the names
    if num_requests is not None:
        if num_requests > len(reqs):
            raise ValueError(f"bench.num_requests={num_requests} is invalid: the workload "
                             f"{spec!r} holds {len(reqs)}; allowed is at most that")
        reqs = reqs[:num_requests]
    if rate is not None:
        reqs = poisson(reqs, rate, seed)
    check(reqs, vocab_size, spec)
    return reqs


def check(reqs: list[BenchRequest], vocab_size: int, source: str) -> None:
    """ValueError naming `source` (bench.workload) and the first bad request."""
    problem = None if reqs else "no requests"
    for i, r in enumerate(reqs):
        if problem:
            break
        if not r.prompt_token_ids:
            problem = f"request {i}: empty prompt_token_ids"
        elif not all(isinstance(t, int) and 0 <= t < vocab_size for t in r.prompt_token_ids):
            problem = f"request {i}: prompt_token_ids outside [0, {vocab_size})"
        elif r.max_new_tokens < 1:
            problem = f"request {i}: max_new_tokens={r.max_new_tokens} (must be >= 1)"
        elif r.arrival_s < 0:
            problem = f"request {i}: arrival_s={r.arrival_s} (must be >= 0)"
    if problem:
        raise ValueError(f"bench.workload={source!r}: {problem}; allowed is at least one request "
                         f"with token ids in [0, {vocab_size}) and max_new_tokens >= 1")


def save(reqs: list[BenchRequest], path: str | Path) -> None:
    """Write a workload file: {"requests": [{prompt_token_ids, max_new_tokens, arrival_s}]}."""
    Path(path).write_text(json.dumps({"requests": [asdict(r) for r in reqs]}))


def load(path: str | Path) -> list[BenchRequest]:
    """Read a workload file; errors name the file and the request."""
    try:
        data = json.loads(Path(path).read_text())
        return [BenchRequest(list(r["prompt_token_ids"]), int(r["max_new_tokens"]),
                             float(r.get("arrival_s", 0.0))) for r in data["requests"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"bench.workload={str(path)!r}: not a readable workload file ({e}); "
                         "allowed is JSON {\"requests\": [{\"prompt_token_ids\": [...], "
                         "\"max_new_tokens\": N}]}") from None


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]
