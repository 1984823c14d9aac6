"""Block manager: allocation, sharing, prefix cache hits, LRU eviction, hit accounting."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from meshserve.engine.core.block_manager import BlockManager, NoFreeBlocksError
from meshserve.engine.core.sequence import Sequence, SequenceStatus

_next_id = iter(range(10**9))
_BASE = (0, 1, 2, 0, 2, 1, 1, 0, 2, 2, 0, 1)


def make_seq(tokens: list[int], seq_id: int | None = None) -> Sequence:
    return Sequence(next(_next_id) if seq_id is None else seq_id, tokens, max_tokens=100)


def run(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Admit `seq` with its cached prefix and compute `num_tokens` more (default: all)."""
    cached = bm.find_cached_prefix(seq)
    start = len(cached) * bm.block_size
    n = seq.num_tokens - start if num_tokens is None else num_tokens
    assert bm.admit(seq, cached, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)


def test_allocation_takes_blocks_in_order_and_free_returns_them() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(list(range(10)))
    assert bm.admit(a, [], 10)
    assert a.block_table == [0, 1, 2] and bm.num_free_blocks == 5
    a.num_computed_tokens = 10
    assert bm.allocate_slots(a, 2)  # 12 tokens still fit 3 blocks
    assert a.block_table == [0, 1, 2]
    assert bm.allocate_slots(a, 3)
    assert a.block_table == [0, 1, 2, 3] and bm.num_used_blocks == 4
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(2, 4, enable_prefix_caching=False)
    a = make_seq(list(range(12)))
    assert not bm.admit(a, [], 12)
    assert a.block_table == [] and bm.num_free_blocks == 2
    assert bm.admit(a, [], 8)
    a.num_computed_tokens = 8
    assert not bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1]
    bm.check_invariants()


def test_prefix_hit_takes_full_computed_blocks_only() -> None:
    bm = BlockManager(8, 4)
    a = make_seq(list(range(10)))
    run(bm, a)  # blocks 0, 1 full and computed, block 2 partial
    b = make_seq(list(range(8)) + [50, 51, 52])
    assert bm.find_cached_prefix(b) == [0, 1]
    c = make_seq(list(range(4)) + [9, 9, 9, 9, 9])
    assert bm.find_cached_prefix(c) == [0]
    d = make_seq([1] + list(range(1, 10)))
    assert bm.find_cached_prefix(d) == []
    assert bm.admit(b, [0, 1], 3)
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert bm.ref_count(0) == 2 and bm.ref_count(1) == 2 and bm.ref_count(3) == 1
    bm.check_invariants()


def test_full_hit_leaves_last_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    run(bm, make_seq(list(range(8))))
    same = make_seq(list(range(8)))
    assert bm.find_cached_prefix(same) == [0]  # the last block is dropped
    longer = make_seq(list(range(9)))
    assert bm.find_cached_prefix(longer) == [0, 1]


def test_uncomputed_blocks_are_not_cached() -> None:
    bm = BlockManager(8, 4)
    a = make_seq(list(range(12)))
    run(bm, a, 6)  # a chunk: only block 0 is full and computed
    assert bm.find_cached_prefix(make_seq(list(range(12)))) == [0]
    bm.allocate_slots(a, 6)
    a.num_computed_tokens = 12
    bm.cache_computed_blocks(a)
    assert bm.find_cached_prefix(make_seq(list(range(12)))) == [0, 1]
    assert bm.find_cached_prefix(make_seq(list(range(13)))) == [0, 1, 2]


def test_generated_tokens_fill_cached_blocks() -> None:
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3])
    run(bm, a)  # computed 3: block 0 cached
    for token in (4, 5):
        a.append_token(token)
        assert bm.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        bm.cache_computed_blocks(a)
    # tokens 1 2 | 3 4 | 5: computed 5, blocks 0 and 1 cached
    bm.free(a)
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == [0, 1]


def test_freed_cached_blocks_stay_reusable_until_evicted() -> None:
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 3, 4, 5])
    run(bm, a)  # blocks 0, 1 cached; 2 partial
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.prefix_cache.num_evictable == 2
    b = make_seq([1, 2, 3, 4, 9])
    run(bm, b)
    assert b.block_table == [0, 1, 3] and b.num_cached_tokens == 4
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_never_cached_blocks_go_first_then_lru() -> None:
    bm = BlockManager(4, 2)
    a = make_seq([1, 2, 0])
    b = make_seq([3, 4, 0])
    run(bm, a)  # blocks 0 (cached), 1
    run(bm, b)  # blocks 2 (cached), 3
    bm.free(a)
    bm.free(b)  # free pool: 1, 3; LRU: 0, 2
    touch = make_seq([1, 2, 7])  # hits block 0 and releases it: LRU becomes 2, 0
    run(bm, touch)
    assert touch.block_table == [0, 1]
    bm.free(touch)  # free pool: 3, 1; LRU: 2, 0
    c = make_seq([5, 6, 7, 8, 9, 9])
    assert bm.admit(c, [], 6)
    assert c.block_table == [3, 1, 2]  # two never-cached blocks, then the LRU one
    assert bm.stats.num_evictions == 1
    assert bm.find_cached_prefix(make_seq([3, 4, 0])) == []
    assert bm.find_cached_prefix(make_seq([1, 2, 0])) == [0]
    bm.check_invariants()


def test_tail_blocks_are_evicted_before_head() -> None:
    bm = BlockManager(4, 1)
    a = make_seq([1, 2, 3, 4])
    run(bm, a)
    bm.free(a)  # 3 blocks cached, one not; freed tail first
    b = make_seq([7, 8])
    assert bm.admit(b, [], 2)
    assert b.block_table == [3, 2]  # the uncached block, then the evicted tail
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4])) == [0, 1]


def test_hash_collisions_are_misses_never_wrong_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("meshserve.engine.core.block_manager.hash_block", lambda parent, tokens: 7)
    bm = BlockManager(16, 2)
    a = make_seq([1, 2, 3, 4, 5])
    run(bm, a)  # block 0 cached under hash 7; block 1 (hash 7 too, other parent) cached
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 0])) == [0, 1]
    assert bm.find_cached_prefix(make_seq([2, 1, 3, 4, 0])) == []
    assert bm.find_cached_prefix(make_seq([1, 2, 4, 3, 0])) == [0]
    b = make_seq([2, 1, 3, 4, 5])  # same hashes, other tokens: its blocks cannot be cached
    run(bm, b)
    assert len(bm.pending) == 0  # nor stay pending
    bm.free(a)
    bm.free(b)
    assert bm.prefix_cache.num_evictable == 2
    assert bm.find_cached_prefix(make_seq([2, 1, 3, 4, 0])) == []
    bm.check_invariants()


def test_hit_accounting_in_tokens_with_short_prompts() -> None:
    bm = BlockManager(16, 4)
    run(bm, make_seq(list(range(10))))  # query 10, hit 0
    run(bm, make_seq(list(range(9))))  # query 9, hit 8
    run(bm, make_seq([1, 2, 3]))  # short: query 3, hit 0
    stats = bm.stats
    assert (stats.num_queries, stats.num_hits, stats.num_short_prompts) == (22, 8, 1)
    assert stats.hit_rate == pytest.approx(8 / 22)


def test_recompute_after_preemption_is_counted_apart() -> None:
    bm = BlockManager(16, 4)
    a = make_seq(list(range(10)))
    run(bm, a)
    bm.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    run(bm, a)
    stats = bm.stats
    assert (stats.num_queries, stats.num_hits) == (10, 0)
    assert (stats.num_recompute_queries, stats.num_recompute_hits) == (10, 8)
    assert a.num_cached_tokens == 0  # set at first admission only


def test_no_prefix_caching_never_hits() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    run(bm, make_seq(list(range(10))))
    assert bm.find_cached_prefix(make_seq(list(range(10)))) == []
    assert bm.stats.num_queries == 0


def test_identical_prompts_computed_together_cache_one_copy() -> None:
    bm = BlockManager(8, 2)
    a, b = make_seq([1, 2, 3]), make_seq([1, 2, 3])
    for seq in (a, b):
        assert bm.admit(seq, bm.find_cached_prefix(seq), 3)
    for seq in (a, b):
        seq.num_computed_tokens = 3
        bm.cache_computed_blocks(seq)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    bm.free(a)
    bm.free(b)
    assert bm.prefix_cache.num_evictable == 1
    assert bm.find_cached_prefix(make_seq([1, 2, 5])) == [0]
    bm.check_invariants()


def test_known_full_blocks_are_pending_from_admission_until_registered() -> None:
    bm = BlockManager(16, 4)
    a = make_seq(list(range(14)))  # 3 full blocks, all pending once admitted
    b = make_seq(list(range(12)) + [50, 51])
    assert bm.find_cached_prefix(b) == [] and bm.pending_block_hash(b, 0) is None
    run(bm, a, 5)  # block 0 computed and registered
    assert len(bm.pending) == 2
    assert bm.find_cached_prefix(b) == [a.block_table[0]]
    assert bm.pending_block_hash(b, 1) == b.block_hashes[1] == a.block_hashes[1]
    assert bm.is_pending(b.block_hashes[2]) and not bm.is_pending(b.block_hashes[0])
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 14
    bm.cache_computed_blocks(a)
    assert len(bm.pending) == 0 and bm.pending_block_hash(b, 1) is None
    assert bm.find_cached_prefix(b) == a.block_table[:3]
    assert bm.pending_block_hash(b, 3) is None  # b's last block could never be looked up
    bm.check_invariants()


def test_freeing_drops_pending_blocks_and_a_comeback_counts_its_output() -> None:
    bm = BlockManager(16, 4)
    a = make_seq(list(range(6)))
    run(bm, a, 2)
    assert bm.is_pending(a.block_hashes[0])
    bm.free(a)  # preempted before registering anything
    assert len(bm.pending) == 0
    a.num_computed_tokens = 0
    for token in (6, 7, 8):
        a.append_token(token)
    run(bm, a, 1)  # 9 known tokens: blocks 0 and 1 pending
    assert len(bm.pending) == 2 and bm.is_pending(a.block_hashes[1])
    bm.free(a)
    assert len(bm.pending) == 0
    off = BlockManager(16, 4, enable_prefix_caching=False)
    c = make_seq(list(range(9)))
    run(off, c, 1)
    assert off.pending is None and off.pending_block_hash(c, 0) is None
    assert not off.is_pending(0)


def test_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    bm = BlockManager(8, 4)
    parent = make_seq(list(range(6)))
    run(bm, parent)
    child = parent.fork(99)
    assert bm.fork(parent, child) == (1, 2)
    assert child.block_table == [0, 2] and bm.ref_count(0) == 2 and bm.ref_count(1) == 1
    full = make_seq(list(range(8)))
    run(bm, full)
    twin = full.fork(100)
    assert bm.fork(full, twin) is None
    assert twin.block_table == full.block_table
    for seq in (parent, child, full, twin):
        bm.free(seq)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_fork_without_a_free_block_raises() -> None:
    bm = BlockManager(2, 4)
    parent = make_seq(list(range(6)))
    run(bm, parent)
    with pytest.raises(NoFreeBlocksError):
        bm.fork(parent, parent.fork(7))
    assert bm.ref_count(0) == 1


@pytest.mark.parametrize("status", [SequenceStatus.FINISHED_LENGTH,
                                    SequenceStatus.FINISHED_STOPPED,
                                    SequenceStatus.FINISHED_ABORTED])
def test_a_length_finish_keeps_the_prompts_partial_block_when_asked(
        status: SequenceStatus) -> None:
    bm = BlockManager(8, 4)
    a = make_seq(list(range(10)))  # 2 full blocks, 2 tokens in the third
    a.keep_tail = True
    run(bm, a)
    partial = a.block_table[2]
    a.append_token(77)  # its first token (the prefill's only one)
    a.set_finished(status)
    bm.free(a)
    if status is SequenceStatus.FINISHED_LENGTH:
        assert a.kv_tail == partial and bm.ref_count(partial) == 1
        assert len(bm.find_cached_prefix(make_seq(list(range(10))))) == 2  # the full ones
        bm.unpin([partial])
    assert bm.num_used_blocks == 0
    whole = make_seq(list(range(8)))  # no partial block: nothing kept
    whole.keep_tail = True
    run(bm, whole)
    whole.set_finished(SequenceStatus.FINISHED_LENGTH)
    bm.free(whole)
    assert whole.kv_tail is None and bm.num_used_blocks == 0
    bm.check_invariants()


def test_double_free_is_caught() -> None:
    bm = BlockManager(2, 4)
    a = make_seq([1, 2])
    run(bm, a)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


def test_reset_prefix_cache_frees_unused_cached_blocks() -> None:
    bm = BlockManager(8, 2)
    a = make_seq([1, 2, 3, 4, 5])
    run(bm, a)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5])) == []
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_bad_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / compute / append / fork / free / preempt / evict, checked against a model.

    `kv` simulates the paged cache (block -> tokens written at each offset): a prefix hit
    must return blocks that hold exactly the looked-up tokens.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.seqs: list[Sequence] = []
        self.kv: dict[int, list[int | None]] = {}

    @precondition(lambda self: self.bm is None)
    @rule(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 4]),
          caching=st.sampled_from([True, True, True, False]))
    def init(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.kv = {b: [None] * block_size for b in range(num_blocks)}

    @precondition(lambda self: self.bm is not None and len(self.seqs) < 8)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 2), max_size=8))
    def new_seq(self, data: st.DataObject, tail: list[int]) -> None:
        """A prompt that often shares a prefix with an earlier one (to make prefix hits)."""
        bases = [list(_BASE)] + [s.token_ids for s in self.seqs]
        base = data.draw(st.sampled_from(bases))
        tokens = base[:data.draw(st.integers(0, len(base)))] + tail
        self.seqs.append(make_seq(tokens or [0]))

    @precondition(lambda self: any(not s.block_table for s in self.seqs))
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        bm = self.bm
        seq = data.draw(st.sampled_from([s for s in self.seqs if not s.block_table]))
        cached = bm.find_cached_prefix(seq)
        bs = bm.block_size
        for i, block in enumerate(cached):
            assert self.kv[block] == seq.token_ids[i * bs:(i + 1) * bs], "wrong prefix hit"
        start = len(cached) * bs
        n = data.draw(st.integers(1, seq.num_tokens - start))
        free_before = bm.num_free_blocks
        if bm.admit(seq, cached, n):
            assert seq.num_computed_tokens == start
            self._compute(seq, n)
        else:
            assert seq.block_table == [] and bm.num_free_blocks == free_before

    @precondition(lambda self: any(s.block_table for s in self.seqs))
    @rule(data=st.data(), token=st.integers(0, 2))
    def step(self, data: st.DataObject, token: int) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.block_table]))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)
        n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens))
        if self.bm.allocate_slots(seq, n):
            self._compute(seq, n)

    @precondition(lambda self: any(s.block_table for s in self.seqs) and len(self.seqs) < 10)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from([s for s in self.seqs if s.block_table]))
        child = parent.fork(next(_next_id))
        try:
            copy = self.bm.fork(parent, child)
        except NoFreeBlocksError:
            assert self.bm.num_free_blocks == 0
            return
        if copy is not None:
            self.kv[copy[1]] = list(self.kv[copy[0]])
        self.seqs.append(child)

    @precondition(lambda self: bool(self.seqs))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.bm.free(seq)
        self.seqs.remove(seq)

    @precondition(lambda self: any(s.block_table for s in self.seqs))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.block_table]))
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1

    @precondition(lambda self: self.bm is not None)
    @rule()
    def reset_prefix_cache(self) -> None:
        self.bm.reset_prefix_cache()

    def _compute(self, seq: Sequence, n: int) -> None:
        """Write KV for the next `n` tokens through the block table, as a model step would."""
        bs = self.bm.block_size
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[pos // bs]
            assert self.bm.ref_count(block) == 1, "write into a shared block"
            self.kv[block][pos % bs] = seq.token_ids[pos]
        seq.num_computed_tokens += n
        self.bm.cache_computed_blocks(seq)

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        if bm is None:
            return
        bm.check_invariants()
        expected = [0] * bm.num_blocks
        for seq in self.seqs:
            for block in seq.block_table:
                expected[block] += 1
        assert [bm.ref_count(b) for b in range(bm.num_blocks)] == expected
        assert bm.num_used_blocks == sum(1 for r in expected if r)
        bs = bm.block_size
        for seq in self.seqs:  # every computed token reads back through the block table
            assert len(seq.block_table) * bs >= seq.num_computed_tokens
            for pos in range(seq.num_computed_tokens):
                assert self.kv[seq.block_table[pos // bs]][pos % bs] == seq.token_ids[pos]

    def teardown(self) -> None:
        if self.bm is None:
            return
        for seq in self.seqs:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert not self.bm.pending  # None, or empty once every sequence let go
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBlockManagerMachine = BlockManagerMachine.TestCase
