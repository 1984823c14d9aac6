"""Pending prefixes: a multiset of block hashes, per-sequence spans that shrink from the front."""

from __future__ import annotations

import pytest

from meshserve.engine.core.pending_prefixes import PendingPrefixes


def test_spans_shrink_from_the_front_and_shared_hashes_are_counted() -> None:
    p = PendingPrefixes()
    p.add(1, [10, 11, 12, 13], 1, 4)  # blocks 1..3 pending; block 0 was a cache hit
    p.add(2, [10, 11, 22], 0, 3)
    assert [h in p for h in (10, 11, 12, 13, 22)] == [True, True, True, True, True]
    assert len(p) == 5
    p.advance(1, 2)  # block 1 registered: 11 is still pending through sequence 2
    assert 11 in p and 12 in p
    p.advance(2, 2)
    assert 10 not in p and 11 not in p and 22 in p
    p.advance(1, 1)  # going back is a no-op
    p.advance(1, 9)  # past the end: the span is gone
    assert 12 not in p and 13 not in p and len(p) == 1
    p.check_invariants()


def test_discard_drops_the_rest_of_a_span_and_unknown_ids_are_ignored() -> None:
    p = PendingPrefixes()
    p.add(1, [10, 11, 12], 0, 3)
    p.add(2, [10, 11], 0, 2)
    p.advance(1, 1)
    p.discard(1)
    assert 10 in p and 11 in p and 12 not in p
    p.discard(1)
    p.advance(7, 3)
    p.add(3, [5], 1, 1)  # an empty span is not kept
    p.discard(2)
    assert len(p) == 0
    p.check_invariants()


def test_a_sequence_cannot_add_twice() -> None:
    p = PendingPrefixes()
    p.add(1, [10], 0, 1)
    with pytest.raises(AssertionError):
        p.add(1, [10], 0, 1)
