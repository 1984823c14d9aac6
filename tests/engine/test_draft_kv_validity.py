"""The draft model's KV shares the target's block ids: a prefix-cache hit or a KV import
brings the target's KV, and the draft's only where the draft computed those blocks. Where
it did not (the blocks were filled by a request that does not draft, while drafting was
priced out, or read from a prefill replica), the draft catches up first, so acceptance
equals a cold run's, token for token."""

from __future__ import annotations

import pytest

from meshserve import LLM, SamplingParams
from meshserve.engine.core.block_manager import BlockManager
from meshserve.engine.core.sequence import Sequence

PROMPT = ("import os\nimport sys\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
          "description='x')\n    parser.add_argument('--name', default='world')\n"
          "    args = parser.parse_args(argv)\n")
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
BASE = ["parallel=single", "threads=1", "speculative=draft", "engine.block_size=8"]


def counts(out) -> tuple[int, int, list[int]]:
    m = out.metrics
    return m.num_draft_tokens, m.num_accepted_tokens, out.token_ids


@pytest.fixture(scope="module")
def cold() -> tuple[int, int, list[int]]:
    with LLM("meshcoder", overrides=[*BASE, "speculative.max_batch_size=64"],
             progress=False) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
    assert out.metrics.num_accepted_tokens > 0
    return counts(out)


def test_blocks_filled_by_a_request_that_does_not_draft(cold) -> None:
    with LLM("meshcoder", overrides=[*BASE, "speculative.max_batch_size=64"],
             progress=False) as llm:
        # seeded sampling never drafts (its output must not depend on its batch)
        llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.8, seed=3))
        hit = llm.generate([PROMPT], GREEDY)[0]
    assert hit.metrics.num_cached_tokens > 0
    assert counts(hit) == cold


def test_blocks_filled_while_drafting_was_priced_out(cold) -> None:
    """max_batch_size=1: the prompt arrives while two others decode, so no step drafts
    and its prompt never runs on the draft; alone later, it hits its blocks and drafts."""
    with LLM("meshcoder", overrides=[*BASE, "speculative.max_batch_size=1"],
             progress=False) as llm:
        engine = llm.engine
        long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        for text in ("class Stack:\n    def __init__(self):\n", "def add(a, b):\n"):
            engine.add_request(text, long)
        engine.step()
        engine.add_request(PROMPT, SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        assert engine.stats.spec.num_drafts == 0  # priced out throughout
        hit = llm.generate([PROMPT], GREEDY)[0]
    assert hit.metrics.num_cached_tokens > 0
    assert counts(hit) == cold


def test_blocks_imported_from_a_prefill_replica(cold) -> None:
    with LLM("meshcoder", overrides=[*BASE, "speculative.max_batch_size=64", "disagg=manual",
                                     "disagg.min_prefill_tokens=16"], progress=False) as llm:
        out = llm.generate([PROMPT], GREEDY)[0]
        assert llm.engine.transfers.num_transfers == 1
    drafted, accepted, tokens = cold
    # The decode replica starts after the first token: its drafts are the cold run's
    # after it (a verify step of the cold run may straddle that token, so within one).
    assert out.token_ids == tokens
    assert abs(out.metrics.num_accepted_tokens - accepted) <= 1


def test_a_fresh_block_is_never_taken_as_draft_valid() -> None:
    bm = BlockManager(6, 4)
    seq = Sequence(0, list(range(10)), max_tokens=4)
    assert bm.admit(seq, [], 10)
    bm.mark_draft_computed(seq, 0, 8)  # the draft computed its two full blocks
    assert bm.draft_valid_tokens(seq, 9) == 8 and bm.draft_valid_tokens(seq, 5) == 5
    other = Sequence(1, list(range(10)), max_tokens=4)
    bm.free(seq)
    bm.free(other) if other.block_table else None
    imp = bm.begin_import(list(range(100, 113)))  # reuses freed blocks for new tokens
    assert imp is not None
    for block in imp.blocks:
        assert not bm._draft_valid[block]
