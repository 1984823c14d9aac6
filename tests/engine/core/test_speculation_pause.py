"""When a request's drafts keep failing, it decodes plainly for a while: the rule weighs
its own verify steps against a prior of the run's, in the run's own units."""

from __future__ import annotations

from types import SimpleNamespace

from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.config.speculative_config import SpeculativeConfig
from meshserve.engine.core.drafting import DraftPlanner
from meshserve.engine.core.scheduler import Scheduler


def scheduler(k: int, verify_steps: int, drafted_each: int, accepted_each: int) -> Scheduler:
    sched = Scheduler(EngineConfig(), num_blocks=64, max_model_len=256,
                      speculative=SpeculativeConfig(method="ngram", num_tokens=k))
    for _ in range(verify_steps):
        sched.spec_stats.add(drafted_each, accepted_each)
    return sched


def planner(sched: Scheduler) -> DraftPlanner:
    assert sched.drafting is not None
    return sched.drafting


def request(drafted: int, accepted: int) -> SimpleNamespace:
    return SimpleNamespace(num_draft_tokens=drafted, num_accepted_tokens=accepted,
                           speculate=True, plain_steps=0)


def test_a_short_draft_failing_once_in_a_run_that_accepts_all_does_not_pause() -> None:
    """k = 8 but the proposer drafts one token a step, all accepted: one failed draft
    weighs against eight prior steps of one accepted draft each, not of eight drafts."""
    sched = scheduler(k=8, verify_steps=50, drafted_each=1, accepted_each=1)
    seq = request(drafted=1, accepted=0)
    planner(sched)._pause_if_failing(seq, 0)
    assert seq.speculate


def test_a_request_failing_far_below_the_run_pauses() -> None:
    sched = scheduler(k=4, verify_steps=50, drafted_each=4, accepted_each=2)
    fresh = request(drafted=8, accepted=0)  # two failed verifies at its start
    planner(sched)._pause_if_failing(fresh, 0)
    assert fresh.speculate
    failing = request(drafted=80, accepted=0)
    planner(sched)._pause_if_failing(failing, 0)
    assert not failing.speculate and failing.plain_steps == 0


def test_decodes_prompt_lookup_finds_nothing_for_lower_what_drafting_promises() -> None:
    """A drafting step emits one token for a sequence whose prompt lookup found no match:
    the switch's gain counts such decodes as drafting steps that accepted nothing."""
    from meshserve.engine.core.sequence import Sequence

    sched = Scheduler(EngineConfig(block_size=4), num_blocks=64, max_model_len=256,
                      speculative=SpeculativeConfig(method="ngram", num_tokens=4,
                                                    max_batch_size=8))
    seqs = []
    for i in range(2):
        s = Sequence(i, list(range(10 * i, 10 * i + 6)), max_tokens=40, arrival_time=float(i))
        s.speculate = True
        sched.add(s)
        seqs.append(s)
    out = sched.schedule()
    sched.update(out, {x.seq_id: 100 + x.seq_id for x in out.scheduled})
    before = planner(sched).acceptances(seqs)
    for _ in range(6):  # histories that never repeat: nothing to look up
        out = sched.schedule()
        assert all(x.num_drafts == 0 for x in out.scheduled)
        sched.update(out, {x.seq_id: 200 + 10 * x.seq_id + x.start_pos for x in out.scheduled})
    assert [s.num_missed_drafts for s in seqs] == [6, 6]
    after = planner(sched).acceptances(seqs)
    assert all(a < b / 2 for a, b in zip(after, before)), (before, after)
