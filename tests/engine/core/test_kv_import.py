"""Importing a prompt's KV into the block manager: blocks it already caches are not asked
for, the rest land in pinned fresh blocks, and once written the prompt's admission hits
them all; the tokens after the last full block land in a block of their own, which the
request's admission takes in; every block comes back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.engine.core.block_manager import BlockManager, KVImport
from meshserve.engine.core.sequence import Sequence

BS = 4


def _seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, tokens, max_tokens=10)


def _run(bm: BlockManager, seq: Sequence) -> None:
    cached = bm.find_cached_prefix(seq)
    n = seq.num_tokens - len(cached) * BS
    assert bm.admit(seq, cached, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)


def test_a_written_import_is_a_prefix_hit_for_the_prompt() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(14))  # 3 full blocks before the last token, 2 tokens after
    imp = bm.begin_import(prompt)
    assert imp is not None and imp.first_block == 0 and len(imp.blocks) == 3
    assert bm.num_used_blocks == 3  # pinned while the transfer runs
    bm.finish_import(imp, written=True)
    assert bm.num_used_blocks == 0
    seq = _seq(prompt)
    assert len(bm.find_cached_prefix(seq)) == 3
    bm.check_invariants()


def test_blocks_already_cached_are_not_asked_for() -> None:
    bm = BlockManager(16, BS)
    shared = list(range(8))
    done = _seq([*shared, 50, 51, 52, 53, 54])
    _run(bm, done)
    bm.free(done)
    imp = bm.begin_import([*shared, 60, 61, 62, 63, 64, 65])
    assert imp is not None and imp.first_block == 2 and len(imp.blocks) == 1
    bm.finish_import(imp, written=False)  # a failed transfer caches nothing new
    assert len(bm.find_cached_prefix(_seq([*shared, 60, 61, 62, 63, 64, 65]))) == 2
    bm.check_invariants()


def test_too_few_free_blocks_and_no_prefix_cache() -> None:
    bm = BlockManager(2, BS)
    assert bm.begin_import(list(range(13))) is None  # needs 3
    assert bm.num_free_blocks == 2
    with pytest.raises(ValueError, match="engine.enable_prefix_caching=False is invalid"):
        BlockManager(4, BS, enable_prefix_caching=False).begin_import([1, 2, 3, 4, 5])


def test_a_tail_lands_in_its_own_block_and_the_admission_computes_one_token() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(14))  # 3 full blocks, then 2 tokens in the tail
    imp = bm.begin_import(prompt[:13], tail=True)
    assert imp is not None and imp.tail is not None and imp.written == [*imp.blocks, imp.tail]
    assert bm.num_used_blocks == 4
    tail = bm.finish_import(imp, written=True)
    assert tail is not None and bm.num_used_blocks == 1  # the tail stays held, for the request
    seq = _seq([*prompt, 99])  # the prompt and its first token
    seq.kv_tail = tail
    cached = bm.find_cached_prefix(seq)
    assert len(cached) == 3 and bm.tail_rows(seq, 3) == 2
    assert bm.admit(seq, cached, 1)
    assert seq.num_computed_tokens == 14 and seq.block_table == [*cached, tail]
    assert seq.kv_tail is None and seq.num_cached_tokens == 12  # the tail is no prefix hit
    bm.free(seq)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_a_tail_after_a_lost_prefix_is_dropped_and_an_unwritten_one_freed() -> None:
    bm = BlockManager(16, BS)
    prompt = list(range(14))
    imp = bm.begin_import(prompt[:13], tail=True)
    assert imp is not None
    tail = bm.finish_import(imp, written=True)
    bm.reset_prefix_cache()  # the full blocks before the tail are evicted
    seq = _seq([*prompt, 99])
    seq.kv_tail = tail
    assert bm.find_cached_prefix(seq) == [] and bm.tail_rows(seq, 0) == 0
    assert bm.admit(seq, [], 15)  # the whole prompt is computed; the tail goes back
    assert seq.kv_tail is None and tail not in seq.block_table
    bm.free(seq)
    failed = bm.begin_import(prompt[:13], tail=True)
    assert failed is not None and bm.finish_import(failed, written=False) is None
    waiting = _seq([*prompt, 99], seq_id=1)  # a tail given to a request aborted unadmitted
    imp = bm.begin_import(prompt[:13], tail=True)
    assert imp is not None
    waiting.kv_tail = bm.finish_import(imp, written=True)
    bm.free(waiting)
    assert bm.num_used_blocks == 0 and waiting.kv_tail is None
    bm.check_invariants()


PROMPTS = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=20), min_size=1,
                   max_size=8)


@settings(max_examples=200, deadline=None)
@given(PROMPTS, st.lists(st.booleans(), min_size=8, max_size=8),
       st.lists(st.booleans(), min_size=8, max_size=8), st.integers(3, 12))
def test_imports_pin_then_return_every_block(prompts: list[list[int]], written: list[bool],
                                             tails: list[bool], num_blocks: int) -> None:
    bm = BlockManager(num_blocks, BS)
    open_imports: list[tuple[KVImport, bool]] = []
    kept: list[int] = []  # tails of written imports, as requests would hold them

    def finish(imp: KVImport, with_tail: bool, ok: bool) -> None:
        tail = bm.finish_import(imp, written=ok)
        assert (tail is not None) == (ok and with_tail)
        kept.extend([tail] if tail is not None else [])

    for i, prompt in enumerate(prompts):
        tail = tails[i]
        imp = bm.begin_import(prompt, tail=tail)
        if imp is None:  # refused only when short
            assert (len(prompt) - 1) // BS + tail > bm.num_free_blocks
        else:
            held = imp.cached + imp.written
            assert len(set(held)) == len(held) == (len(prompt) - 1) // BS + tail
            for other, _ in open_imports:  # no block is in two transfers at once
                assert not set(imp.written) & set(other.cached + other.written)
            assert not set(held) & set(kept)
            open_imports.append((imp, tail))
        bm.check_invariants()
        if i % 2:  # finish the oldest, written or not
            if open_imports:
                finish(*open_imports.pop(0), written[i])
                bm.check_invariants()
    for imp, with_tail in open_imports:
        finish(imp, with_tail, True)
    bm.unpin(kept)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks
    bm.check_invariants()


def test_a_streamed_import_takes_its_tail_at_the_end_or_goes_without() -> None:
    bm = BlockManager(5, BS)
    imp = bm.begin_import(list(range(12)) + [0])  # 3 full blocks; the tail not yet known
    assert imp is not None and imp.tail is None and bm.num_used_blocks == 3
    assert bm.add_import_tail(imp) and imp.tail is not None and bm.num_used_blocks == 4
    other = bm.begin_import(list(range(100, 104)) + [0])  # the last free block
    assert other is not None and bm.num_free_blocks == 0
    assert not bm.add_import_tail(other)  # none left: its tail tokens are computed
    bm.finish_import(other, written=False)
    bm.finish_import(imp, written=False)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


def test_pinned_blocks_of_a_finished_prompt_outlive_it_until_unpinned() -> None:
    """A prompt's blocks read while it is computed stay put when it is freed (finished,
    preempted, aborted) until the read ends."""
    bm = BlockManager(8, BS)
    seq = _seq(list(range(10)))
    _run(bm, seq)
    read = seq.block_table[:2]
    bm.pin(read)
    bm.free(seq)
    assert bm.num_used_blocks == 2 and bm.num_free_blocks == 6
    other = _seq(list(range(50, 74)), seq_id=1)  # wants every free block
    assert bm.admit(other, [], 24)
    assert not set(other.block_table) & set(read)
    bm.free(other)
    bm.unpin(read)
    assert bm.num_used_blocks == 0
    with pytest.raises(AssertionError, match="not in use"):
        bm.pin([read[0]])
    bm.check_invariants()
