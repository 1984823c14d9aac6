"""Sliding-window attention gives back the KV blocks wholly behind the window: block counts
bounded by the window, tokens identical to transformers, prefix caching still right."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve import LLM, SamplingParams
from meshserve.engine.core.block_manager import BlockManager, cdiv
from meshserve.engine.core.sequence import Sequence

WINDOW, BLOCK = 16, 4
NEW = 4 * WINDOW


def held(bm: BlockManager, seq: Sequence) -> int:
    return len(set(seq.block_table[seq.num_released_blocks:]))


def test_release_keeps_positions_and_frees_only_whole_blocks() -> None:
    bm = BlockManager(32, BLOCK, enable_prefix_caching=False, sliding_window=WINDOW)
    seq = Sequence(0, list(range(30)), max_tokens=8)
    assert bm.admit(seq, [], 30)
    seq.num_computed_tokens = 30
    table = list(seq.block_table)
    # The next query (position 30) reads keys 15..30: blocks 0..2 (positions 0..11) go.
    assert bm.release_behind_window(seq, 30) == 3
    assert seq.num_released_blocks == 3
    assert seq.block_table[3:] == table[3:] and len(seq.block_table) == len(table)
    assert all(bm.ref_count(b) == 0 for b in table[:3])
    assert bm.release_behind_window(seq, 30) == 0  # idempotent
    bm.check_invariants()
    bm.free(seq)
    assert bm.num_free_blocks == 32 and seq.num_released_blocks == 0
    bm.check_invariants()


def test_with_prefix_caching_a_block_goes_only_once_registered() -> None:
    bm = BlockManager(32, BLOCK, sliding_window=1)
    seq = Sequence(0, list(range(30)), max_tokens=8)
    assert bm.admit(seq, [], 30)
    seq.num_computed_tokens = 8  # two blocks computed and registered, the rest not yet
    bm.cache_computed_blocks(seq)
    assert bm.release_behind_window(seq, 30) == 2
    seq.num_computed_tokens = 30
    bm.cache_computed_blocks(seq)
    assert bm.release_behind_window(seq, 30) == 5
    bm.check_invariants()
    again = Sequence(1, list(range(30)), max_tokens=8)
    hit = bm.find_cached_prefix(again)
    assert len(hit) == 7  # released blocks stay findable by hash until evicted
    used = bm.num_used_blocks
    assert bm.admit(again, hit, 2)  # the hit's blocks behind the window are not taken
    assert again.num_released_blocks == 7 and bm.num_used_blocks == used + 1
    bm.check_invariants()
    bm.free(seq)
    bm.free(again)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(window=st.integers(1, 40), block=st.sampled_from([1, 2, 4, 8]),
       prompt=st.integers(1, 60), steps=st.integers(0, 80), caching=st.booleans())
def test_decoding_holds_blocks_bounded_by_the_window(window: int, block: int, prompt: int,
                                                     steps: int, caching: bool) -> None:
    bm = BlockManager(256, block, enable_prefix_caching=caching, sliding_window=window)
    seq = Sequence(0, list(range(prompt)), max_tokens=steps + 1)
    assert bm.admit(seq, bm.find_cached_prefix(seq), prompt)
    seq.num_computed_tokens = prompt
    bm.cache_computed_blocks(seq)
    for t in range(steps):
        bm.release_behind_window(seq, seq.num_computed_tokens)
        assert held(bm, seq) <= cdiv(window, block) + 1
        seq.append_token(t)
        assert bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_computed_blocks(seq)
        bm.check_invariants()
    bm.free(seq)
    assert bm.num_used_blocks == 0
    bm.check_invariants()


MODES = {
    "continuous": [],
    "chunk-7": ["engine.max_num_batched_tokens=7"],
    "async": ["engine.async_scheduling=true"],
    "40-blocks": ["engine.num_gpu_blocks=40"],
    "preempt": ["engine.num_gpu_blocks=12", "engine.max_num_batched_tokens=8"],
}


@pytest.fixture(scope="module")
def mistral(make_checkpoint):
    return make_checkpoint("mistral", sliding_window=WINDOW)


@pytest.fixture(scope="module")
def expected(mistral, hf_reference, prompts) -> list[list[int]]:
    hf = hf_reference(mistral)
    return [hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                        do_sample=False)[0, len(p):].tolist() for p in prompts[:4]]


@pytest.mark.parametrize("mode", MODES)
def test_a_long_generation_holds_kv_bounded_by_the_window(mistral, prompts, expected,
                                                          mode) -> None:
    llm = LLM(str(mistral), overrides=["parallel=single", f"engine.block_size={BLOCK}",
                                       *MODES[mode]], progress=False)
    engine = llm.engine
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts[:4]]
    peak, done = 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        peak = max(peak, engine.scheduler.block_manager.num_used_blocks)
    assert [done[i] for i in ids] == expected
    # Without release: each sequence would end holding cdiv(len + NEW, BLOCK) blocks.
    bound = 4 * (cdiv(WINDOW, BLOCK) + 2)
    assert peak <= bound, (peak, bound)
    assert engine.stats.num_free_blocks == engine.num_blocks
    if mode == "40-blocks":  # holding every block, these four would need 72 and preempt
        assert sum(cdiv(len(p) + NEW, BLOCK) for p in prompts[:4]) > 40
        assert engine.stats.num_preemptions == 0
    if mode == "preempt":
        assert engine.stats.num_preemptions > 0


def test_prefix_hits_stay_right_under_the_window(mistral, prompts, expected) -> None:
    llm = LLM(str(mistral), overrides=["parallel=single", f"engine.block_size={BLOCK}"],
              progress=False)
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:4], sp)
    again = llm.generate(prompts[:4], sp)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == expected
    assert sum(o.metrics.num_cached_tokens for o in again) > 0
