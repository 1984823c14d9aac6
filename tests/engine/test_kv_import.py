"""Importing a prompt's KV into the block manager: blocks it already caches are not asked
for, the rest land in pinned fresh blocks, and once written the prompt's admission hits
them all; every block comes back."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.engine.block_manager import BlockManager
from meshserve.engine.sequence import Sequence

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


PROMPTS = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=20), min_size=1,
                   max_size=8)


@settings(max_examples=200, deadline=None)
@given(PROMPTS, st.lists(st.booleans(), min_size=8, max_size=8), st.integers(3, 12))
def test_imports_pin_then_return_every_block(prompts: list[list[int]], written: list[bool],
                                             num_blocks: int) -> None:
    bm = BlockManager(num_blocks, BS)
    open_imports = []
    for i, prompt in enumerate(prompts):
        imp = bm.begin_import(prompt)
        if imp is None:
            assert (len(prompt) - 1) // BS > bm.num_free_blocks  # refused only when short
        else:
            held = imp.cached + imp.blocks
            assert len(set(held)) == len(held) == (len(prompt) - 1) // BS
            for other in open_imports:  # no block is in two transfers at once
                assert not set(imp.blocks) & set(other.cached + other.blocks)
            open_imports.append(imp)
        bm.check_invariants()
        if i % 2:  # finish the oldest, written or not
            oldest = open_imports.pop(0) if open_imports else None
            if oldest is not None:
                bm.finish_import(oldest, written=written[i])
                bm.check_invariants()
    for imp in open_imports:
        bm.finish_import(imp, written=True)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks
    bm.check_invariants()
