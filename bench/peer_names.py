"""Names of the engines a benchmark compares: meshserve, its Hugging Face peers, and
meshserve on one rank (the baseline a multi-rank layout is measured against)."""

from __future__ import annotations

import re

MESHSERVE = "meshserve"
"""Our engine's name in results."""

HF_CONTINUOUS = "hf-continuous"
"""transformers' own continuous batching (paged attention), one process."""

MESHSERVE_SINGLE = "meshserve-single"
"""meshserve itself on one rank (parallel tp = pp = dp = 1), every other setting the run's:
its rounds interleave with the layout under test in one process, so the machine's drift
between minutes falls on both sides of the ratio alike."""

HF_STATIC_PREFIX = "hf-static-"
"""`hf-static-<B>`: transformers `model.generate` in static batches of B, left padded."""

DEFAULT_PEERS = ("hf-static-8", "hf-static-16", HF_CONTINUOUS)
"""The peers of the benchmark protocol (docs/benchmarks/README.md)."""

_STATIC = re.compile(r"hf-static-([1-9][0-9]*)")


def static_batch_size(name: str) -> int | None:
    """B of an `hf-static-<B>` peer, None for any other name."""
    m = _STATIC.fullmatch(name)
    return int(m.group(1)) if m else None


def is_peer(name: str) -> bool:
    """Whether `name` is a peer this harness can run."""
    return name in (HF_CONTINUOUS, MESHSERVE_SINGLE) or static_batch_size(name) is not None
