"""Pending prefixes: full blocks that running sequences are computing and have not cached yet.

A sequence admitted with prefix caching on knows the chained hash of every full block of
its known tokens (prompt, plus earlier output when it comes back from preemption). Until
it registers a block in the prefix cache, that block's hash is pending here. The scheduler
defers a waiting sequence whose next uncached block is pending, so that it hits the block
once it is registered instead of computing the same KV a second time.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass


@dataclass(slots=True)
class _Span:
    hashes: list[int]
    """Hashes of the sequence's blocks [start, end)."""
    start: int
    next: int
    """Index of its first block still pending; start <= next < end."""


class PendingPrefixes:
    """Multiset of pending block hashes, with each sequence's span of them.

    A sequence's span is its blocks [next, end) whose KV is not computed and registered
    yet. It shrinks from the front as blocks are registered and goes entirely when the
    sequence frees its blocks (finish, abort, preemption) or stops registering (hash
    collision), so every pending hash belongs to a sequence holding blocks.
    """

    def __init__(self) -> None:
        self._count: dict[int, int] = {}
        """Block hash -> number of spans holding it (always >= 1)."""
        self._spans: dict[int, _Span] = {}
        """seq_id -> its span; only non-empty spans are kept."""

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._count

    def __len__(self) -> int:
        """Distinct pending hashes."""
        return len(self._count)

    def add(self, seq_id: int, block_hashes: Seq[int], start: int, end: int) -> None:
        """Mark `seq_id`'s blocks [start, end) pending; their hashes are block_hashes[start:end]."""
        assert seq_id not in self._spans, f"sequence {seq_id} has pending blocks already"
        if start >= end:
            return
        hashes = list(block_hashes[start:end])
        assert len(hashes) == end - start, (len(block_hashes), start, end)
        count = self._count
        for h in hashes:
            count[h] = count.get(h, 0) + 1
        self._spans[seq_id] = _Span(hashes, start, start)

    def advance(self, seq_id: int, num_registered: int) -> None:
        """`seq_id`'s first `num_registered` blocks are registered: they are pending no more."""
        span = self._spans.get(seq_id)
        if span is None:
            return
        end = span.start + len(span.hashes)
        stop = min(num_registered, end)
        if stop <= span.next:
            return
        self._drop(span.hashes[span.next - span.start:stop - span.start])
        if stop == end:
            del self._spans[seq_id]
        else:
            span.next = stop

    def discard(self, seq_id: int) -> None:
        """Forget `seq_id`'s pending blocks: it freed them or will never register them."""
        span = self._spans.pop(seq_id, None)
        if span is not None:
            self._drop(span.hashes[span.next - span.start:])

    def _drop(self, hashes: list[int]) -> None:
        count = self._count
        for h in hashes:
            n = count[h] - 1
            if n:
                count[h] = n
            else:
                del count[h]

    def check_invariants(self) -> None:
        """Assert the multiset is the sum of the spans (for tests)."""
        expected: dict[int, int] = {}
        for seq_id, span in self._spans.items():
            first = span.next - span.start
            assert 0 <= first < len(span.hashes), (seq_id, first, len(span.hashes))
            for h in span.hashes[first:]:
                expected[h] = expected.get(h, 0) + 1
        assert expected == self._count, (expected, self._count)
