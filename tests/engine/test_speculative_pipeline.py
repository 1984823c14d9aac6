"""Speculative decoding through a pipeline (pp=2): the driver's n-gram or draft-model drafts
travel with the micro-batch through every stage, the last stage verifies them and returns up
to k + 1 tokens per sequence. Greedy output is plain decoding's; a sampled request is verified
against the draft's own distributions, which travel with the step to the sampling rank."""

from __future__ import annotations

import pytest
from helpers.pipeline import InOrderPipeline
from helpers.speculation import (
    GREEDY,
    ONE_RANK,
    PROMPTS,
    check_aborts_give_every_block_back,
    check_counts,
    plain_outputs,
)

from meshserve import LLM, SamplingParams
from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.config.run import resolve_run
from meshserve.engine.config.speculative_config import SpeculativeConfig
from meshserve.engine.core.scheduler import Scheduler
from meshserve.engine.core.sequence import Sequence
from meshserve.engine.engine import Engine
from meshserve.engine.executor.executor import InProcessExecutor
from meshserve.launch.cli_config import load_config

EVERY_STEP = ["speculative.max_batch_size=64"]
"""Every step drafts (no run-time switch)."""
PP2 = ["parallel.pp=2", "model.dtype=float32"]  # token identity holds in fp32


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return plain_outputs()



@pytest.mark.parametrize("overrides", [
    ["speculative=ngram", *EVERY_STEP],
    ["speculative=ngram", *EVERY_STEP, "engine.max_num_batched_tokens=7"],
    ["speculative=draft", *EVERY_STEP],
    # The last stage samples (on a CPU pipeline the LM head is split by default, and the
    # driver samples); small blocks force preemptions.
    ["speculative=draft", *EVERY_STEP, "parallel.split_lm_head=false",
     "engine.block_size=4", "engine.num_gpu_blocks=40"],
    ["speculative=draft", *EVERY_STEP, "parallel.tp=2"],  # TP x PP: four ranks
    ["speculative=draft"],  # the run-time switch, timed on the pipeline's micro-batches
], ids=["ngram", "ngram-chunk-7", "draft", "draft-last-stage-samples-preempt", "draft-tp2",
        "draft-switch"])
def test_greedy_speculation_through_a_pipeline_is_token_identical(plain, overrides) -> None:
    llm = LLM("meshcoder", overrides=[*overrides, *PP2], progress=False)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == plain
        if "speculative=draft" in overrides and EVERY_STEP[0] not in overrides:
            assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks
            switch = llm.engine.scheduler.switch
            assert switch is not None and switch.probe_length == 3
            assert switch.num_drafted_steps > 0 and switch.num_plain_steps > 0  # both timed
        else:
            check_counts(llm, outs)
        if "engine.num_gpu_blocks=40" in overrides:
            assert llm.engine.stats.num_preemptions > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("head", [["parallel.split_lm_head=false"], []],
                         ids=["last-stage-samples", "split-head"])
def test_sampled_drafts_are_verified_against_the_drafts_distributions(head: list[str]) -> None:
    """One micro-batch at a time, a pipeline schedules exactly as one rank does, and every
    generator is seeded alike: a sampled request's tokens are the same only where the last
    stage verifies the drafts against the draft model's distributions (as point masses,
    they are not)."""
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, ignore_eos=True)
    spec = ["speculative=draft", *EVERY_STEP]
    one = LLM("meshcoder", overrides=[*ONE_RANK, *spec], progress=False)
    try:
        want = [o.token_ids for o in one.generate(PROMPTS, params)]
        drafted = one.engine.stats.spec.num_draft_tokens
    finally:
        one.shutdown()
    llm = LLM("meshcoder", overrides=[*spec, *PP2, *head, "parallel.num_micro_batches=1"],
              progress=False)
    try:
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == want
        assert llm.engine.stats.spec.num_draft_tokens == drafted > 0
        check_counts(llm, outs)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("head", [["parallel.split_lm_head=false"], []],
                         ids=["last-stage-samples", "split-head"])
def test_aborts_in_flight_free_both_caches(head: list[str]) -> None:
    """Greedy and sampled requests drafting through the pipeline; aborting one whose
    micro-batch is in flight (its result still to be sampled) and two others leaves the
    rest running and every block free."""
    llm = LLM("meshcoder", overrides=["speculative=draft", *EVERY_STEP, *PP2, *head,
                                      "engine.block_size=4"], progress=False)
    engine = llm.engine
    try:
        params = [SamplingParams(max_tokens=200, temperature=t, ignore_eos=True)
                  for t in (0.0, 0.8, 0.0, 0.8, 0.0, 0.8)]
        ids = [engine.add_request(PROMPTS[1], p) for p in params]
        while engine.stats.spec.num_draft_tokens == 0 or not engine._in_flight:
            engine.step()
        in_flight = {str(s.seq_id) for out, _ in engine._in_flight for s in out.scheduled}
        victims = [next(i for i in ids if i in in_flight)]
        victims += [i for i in ids if i not in victims][:2]
        check_aborts_give_every_block_back(engine, victims)
    finally:
        llm.shutdown()


def test_drafting_micro_batches_share_the_sequences_evenly(plain) -> None:
    """A drafting decode is 1 + k tokens: the micro-batch budget counts them so, or the
    first sequence's drafts would fill a micro-batch and leave the rest to the next."""
    config = load_config(["model=meshcoder", *ONE_RANK, "speculative=ngram", *EVERY_STEP])
    pipeline = InOrderPipeline(InProcessExecutor(resolve_run(config, env=None),
                                                 progress=False), 2)
    engine = Engine(config, progress=False, executor=pipeline)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS * 2]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert [done[i] for i in ids] == plain * 2
    assert engine.stats.spec.num_accepted_tokens > 0
    # Past the prompts' hand-over, while all ten decode: two groups of five (without the
    # drafts counted, 2 and 8 throughout).
    assert pipeline.decodes[3:13] == [5] * 10, pipeline.decodes
    sizes = pipeline.decodes[3:]
    assert max(abs(a - b) for a, b in zip(sizes, sizes[1:])) <= 2, pipeline.decodes


def test_a_probe_lasts_one_step_on_one_rank_and_the_depth_plus_one_in_a_pipeline() -> None:
    config = load_config(["model=meshcoder", *ONE_RANK, "speculative=ngram"])
    one = Engine(config, progress=False)
    local = InProcessExecutor(resolve_run(config, env=None), progress=False)
    piped = Engine(config, progress=False, executor=InOrderPipeline(local, 2))
    try:
        assert one.scheduler.switch is not None and one.scheduler.switch.probe_length == 1
        assert piped.scheduler.switch is not None and piped.scheduler.switch.probe_length == 3
    finally:
        one.shutdown()
        piped.shutdown()


@pytest.mark.parametrize(("hold", "scheduled"), [(False, [0, 1, 2, 3, 4]), (True, [0, 1])])
def test_a_micro_batch_holds_the_draft_slots_prompt_lookup_leaves_empty(
        hold: bool, scheduled: list[int]) -> None:
    """Five decodes whose histories never repeat (prompt lookup drafts nothing), a budget
    of 10: counted by what they feed they all fit; holding k = 4 slots each, two do."""
    sched = Scheduler(EngineConfig(block_size=4), num_blocks=64, max_model_len=256,
                      speculative=SpeculativeConfig(method="ngram", num_tokens=4,
                                                    max_batch_size=64))
    for i in range(5):
        s = Sequence(i, list(range(10 * i, 10 * i + 6)), max_tokens=8, arrival_time=float(i))
        s.speculate = True
        sched.add(s)
    prompts = sched.schedule()
    sched.update(prompts, {x.seq_id: 100 + x.seq_id for x in prompts.scheduled})
    out = sched.schedule(10, hold_draft_slots=hold)
    assert [x.seq_id for x in out.scheduled] == scheduled
    assert all(x.num_drafts == 0 for x in out.scheduled)
