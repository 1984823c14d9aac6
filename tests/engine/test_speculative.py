"""Speculative decoding with n-gram drafts: greedy output identical to plain decoding in
every scheduling mode and under TP, stops cut inside accepted runs, and what it refuses."""

from __future__ import annotations

import pytest
from helpers.speculation import (
    GREEDY,
    MODES,
    ONE_RANK,
    PROMPTS,
    check_aborts_give_every_block_back,
    check_prefix_hits_under_tensor_parallel,
    plain_outputs,
)

from meshserve import LLM, SamplingParams

SPEC = ["speculative=ngram", "speculative.max_batch_size=64"]
"""Every step drafts (no run-time switch): the tests check what drafting does."""


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return plain_outputs()


@pytest.mark.parametrize("mode", MODES)
def test_greedy_ngram_is_token_identical(plain, mode: str) -> None:
    llm = LLM("meshcoder", overrides=[*ONE_RANK, *SPEC, *MODES[mode]], progress=False)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == plain
        stats = llm.engine.stats
        assert stats.num_free_blocks == llm.engine.num_blocks
        assert stats.spec.num_accepted_tokens > 0  # drafts were accepted, not only made
        assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.spec.num_accepted_tokens
        assert sum(o.metrics.num_draft_tokens for o in outs) == stats.spec.num_draft_tokens
        assert sum(stats.spec.accepted_per_position) == stats.spec.num_accepted_tokens
        if mode == "preempt":
            assert stats.num_preemptions > 0
    finally:
        llm.shutdown()


def test_prefix_hits_and_tensor_parallel(plain) -> None:
    check_prefix_hits_under_tensor_parallel(SPEC, plain)


REPEATS = "import os\nimport sys\nimport os\nimport sys\nimport"
"""A prompt whose continuation prompt lookup drafts almost entirely."""


def test_stops_and_limits_inside_an_accepted_run_cut_exactly() -> None:
    base = LLM("meshcoder", overrides=ONE_RANK, progress=False)
    spec = LLM("meshcoder", overrides=[*ONE_RANK, *SPEC], progress=False)
    try:
        full = base.generate([REPEATS], GREEDY)[0]
        cases = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                 for n in (1, 2, 5, 13)]
        cases += [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                 stop_token_ids=[full.token_ids[i]]) for i in (3, 9)]
        cases += [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                 stop=[full.text[8:14]]),
                  SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                 stop=[full.text[20:23]])]
        want = base.generate([REPEATS] * len(cases), cases)
        got = spec.generate([REPEATS] * len(cases), cases)
        for w, g in zip(want, got):
            assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text,
                                                               w.finish_reason)
        assert spec.engine.stats.spec.num_accepted_tokens > 0
        assert spec.engine.stats.num_free_blocks == spec.engine.num_blocks
    finally:
        base.shutdown()
        spec.shutdown()


def test_seeded_requests_decode_plainly_and_unseeded_ones_speculate() -> None:
    """Whether a step drafts depends on its batch; a seed promises the same output whatever
    the batch, so seeded sampled requests never draft (their output is the plain one)."""
    base = LLM("meshcoder", overrides=ONE_RANK, progress=False)
    spec = LLM("meshcoder", overrides=[*ONE_RANK, *SPEC], progress=False)
    try:
        seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=5,
                                ignore_eos=True)
        want = base.generate(PROMPTS[2:3], seeded)[0]
        batch = spec.generate(PROMPTS, [seeded] * len(PROMPTS))
        assert batch[2].token_ids == want.token_ids
        assert all(o.metrics.num_draft_tokens == 0 for o in batch)
        free = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)
        outs = spec.generate([REPEATS] * 4, free)
        assert all(len(o.token_ids) == 24 for o in outs)
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0
        assert spec.engine.stats.num_free_blocks == spec.engine.num_blocks
    finally:
        base.shutdown()
        spec.shutdown()


def test_requests_that_read_positions_decode_plainly_beside_speculating_ones(plain) -> None:
    spec = LLM("meshcoder", overrides=[*ONE_RANK, *SPEC], progress=False)
    try:
        lp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
        outs = spec.generate(PROMPTS[:2], [lp, GREEDY])
        assert outs[0].metrics.num_draft_tokens == 0 and len(outs[0].logprobs) == 40
        assert outs[1].metrics.num_draft_tokens > 0
        assert [o.token_ids for o in outs] == plain[:2]
    finally:
        spec.shutdown()


@pytest.mark.parametrize("overrides, words", [
    (["speculative.method=ngram", "speculative.num_tokens=0"], "speculative.num_tokens"),
])
def test_what_it_does_not_do_is_refused_at_start(overrides: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        LLM("meshcoder", overrides=["threads=1", *overrides], progress=False)


def test_aborts_mid_speculation_give_every_block_back() -> None:
    spec = LLM("meshcoder", overrides=[*ONE_RANK, *SPEC, "engine.block_size=4"],
               progress=False)
    engine = spec.engine
    try:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(REPEATS, long) for _ in range(3)]
        for _ in range(12):
            engine.step()
        assert engine.stats.spec.num_draft_tokens > 0
        check_aborts_give_every_block_back(engine, ids[:2])
    finally:
        spec.shutdown()
