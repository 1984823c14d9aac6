"""Drafts are sized from the step's token budget, after the decodes: no running decode is
left out of a step so that another sequence's drafts fit (a property over random batches,
draft lengths and budgets). A pipeline's micro-batch (hold_draft_slots) is its share of
the sequences by design, the rest going in the next one: not covered here."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.config.speculative_config import SpeculativeConfig
from meshserve.engine.core.scheduler import Scheduler
from meshserve.engine.core.sequence import Sequence


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 6), st.integers(0, 40), st.lists(
    st.integers(4, 40), min_size=0, max_size=3))
def test_every_decode_is_scheduled_before_any_draft(num_decodes: int, k: int, extra: int,
                                                    prompts: list[int]) -> None:
    sched = Scheduler(EngineConfig(block_size=4, max_num_seqs=16), num_blocks=512,
                      max_model_len=512,
                      speculative=SpeculativeConfig(method="ngram", num_tokens=k,
                                                    max_batch_size=64))
    for i in range(num_decodes):  # prompt lookup always matches: drafts of k tokens
        seq = Sequence(i, [5 + i] * 12, max_tokens=100)
        seq.speculate = True
        sched.add(seq)
    out = sched.schedule()
    sched.update(out, {s.seq_id: 5 + s.seq_id for s in out.scheduled if s.sample})
    assert sched.num_running == num_decodes
    for j, n in enumerate(prompts):  # prompts still to prefill, behind the decodes
        sched.add(Sequence(100 + j, [7 + j] * n, max_tokens=4))
    budget = num_decodes + extra
    out = sched.schedule(budget)
    decoded = {s.seq_id for s in out.scheduled if s.seq_id < 100}
    assert decoded == set(range(num_decodes)), (budget, k, [
        (s.seq_id, s.num_drafts) for s in out.scheduled])
    assert out.num_batched_tokens <= budget
    if extra:  # budget past the decodes goes to drafts (the proposer finds one at least)
        assert any(s.num_drafts for s in out.scheduled)
