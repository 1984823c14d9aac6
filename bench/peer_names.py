"""Names of the engines a benchmark compares: meshserve and its Hugging Face peers."""

from __future__ import annotations

import re

MESHSERVE = "meshserve"
"""Our engine's name in results."""

HF_CONTINUOUS = "hf-continuous"
"""transformers' own continuous batching (paged attention), one process."""

HF_STATIC_PREFIX = "hf-static-"
"""`hf-static-<B>`: transformers `model.generate` in static batches of B, left padded."""

DEFAULT_PEERS = ("hf-static-8", "hf-static-16", HF_CONTINUOUS)
"""BENCH.md's peers."""

_STATIC = re.compile(r"hf-static-([1-9][0-9]*)")


def static_batch_size(name: str) -> int | None:
    """B of an `hf-static-<B>` peer, None for any other name."""
    m = _STATIC.fullmatch(name)
    return int(m.group(1)) if m else None


def is_peer(name: str) -> bool:
    """Whether `name` is a peer this harness can run."""
    return name == HF_CONTINUOUS or static_batch_size(name) is not None
