"""KV leases on the prefill side: every held block handed back exactly once, never while
a read of it is in flight; reads after a lapse fail."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.engine.kv_transfer.leases import KVLeases, LeaseExpired


def test_a_read_frees_the_blocks_at_its_end() -> None:
    leases = KVLeases(lease_s=5.0)
    leases.hold("a", [3, 4], now=0.0)
    assert not leases.reading("a") and not leases.reading("b")
    assert leases.begin_read("a", now=1.0) == (3, 4)
    assert leases.reading("a")
    assert leases.expire(now=100.0) == []  # a read in flight never lapses
    assert leases.end_read("a") == (3, 4)
    assert len(leases) == 0 and not leases.reading("a")


def test_a_lapsed_lease_is_counted_and_a_later_read_fails() -> None:
    leases = KVLeases(lease_s=2.0)
    leases.hold("a", [1], now=0.0)
    leases.hold("b", [2], now=1.5)
    assert leases.expire(now=2.5) == [("a", (1,))]
    assert leases.num_expired == 1
    with pytest.raises(LeaseExpired, match=r"'a'.*expired after disagg.kv_lease_s=2.0 s"):
        leases.begin_read("a", now=2.6)
    with pytest.raises(LeaseExpired, match="holds no lease"):
        leases.begin_read("zzz", now=2.6)
    # Past its deadline but not yet swept: the read fails all the same.
    with pytest.raises(LeaseExpired, match="'b'"):
        leases.begin_read("b", now=4.0)


def test_an_abort_during_a_read_defers_the_free_to_its_end() -> None:
    leases = KVLeases(lease_s=5.0)
    leases.hold("a", [7, 8], now=0.0)
    leases.hold("b", [9], now=0.0)
    assert leases.abort("b") == (9,)
    leases.begin_read("a", now=0.1)
    assert leases.abort("a") == () and leases.reading("a")
    assert leases.end_read("a") == (7, 8)
    assert leases.abort("a") == ()  # gone: nothing twice


def test_protocol_errors_and_a_bad_lease() -> None:
    with pytest.raises(ValueError, match=r"disagg.kv_lease_s=0 is invalid: allowed is a "
                                         "positive number"):
        KVLeases(lease_s=0)
    leases = KVLeases(lease_s=1.0)
    leases.hold("a", [1], now=0.0)
    with pytest.raises(RuntimeError, match="already holds"):
        leases.hold("a", [2], now=0.0)
    with pytest.raises(RuntimeError, match="no read"):
        leases.end_read("a")
    leases.begin_read("a", now=0.0)
    with pytest.raises(RuntimeError, match="already being read"):
        leases.begin_read("a", now=0.0)


OPS = st.lists(st.tuples(st.sampled_from(["hold", "begin", "end", "abort", "expire"]),
                         st.integers(0, 5), st.floats(0.0, 3.0)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_block_comes_back_once_and_never_mid_read(ops: list[tuple[str, int, float]]
                                                        ) -> None:
    leases = KVLeases(lease_s=1.0)
    now, next_block = 0.0, 0
    held: set[int] = set()
    returned: list[int] = []
    reads: dict[str, set[int]] = {}  # the reads begun and not ended, as this test saw them
    for op, rid_n, dt in ops:
        rid = f"r{rid_n}"
        now += dt
        reading = {b for blocks in reads.values() for b in blocks}
        got: tuple[int, ...] = ()
        if op == "hold" and rid not in leases:
            blocks = [next_block, next_block + 1]
            next_block += 2
            held.update(blocks)
            leases.hold(rid, blocks, now)
        elif op == "begin":
            try:
                reads[rid] = set(leases.begin_read(rid, now))
            except (LeaseExpired, RuntimeError):
                pass
        elif op == "end":
            try:
                got = leases.end_read(rid)
            except RuntimeError:
                pass
            else:
                assert set(got) == reads.pop(rid)  # the read's own blocks, now done
                reading -= set(got)
        elif op == "abort":
            got = leases.abort(rid)
        elif op == "expire":
            got = tuple(b for _, blocks in leases.expire(now) for b in blocks)
        assert not set(got) & reading, "a block handed back while a read moves it"
        returned.extend(got)
    for rid in leases.request_ids():
        try:
            returned.extend(leases.end_read(rid))
        except RuntimeError:
            returned.extend(leases.abort(rid))
    assert sorted(returned) == sorted(held)  # each exactly once, none lost
    assert len(leases) == 0

