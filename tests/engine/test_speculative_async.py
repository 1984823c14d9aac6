"""Speculation under async scheduling: steps that do not draft are scheduled while the
step before runs; a step that drafts first waits for the step in flight. Greedy output is
plain decoding's, token for token, across the switches between the two."""

from __future__ import annotations

import pytest
from helpers.speculation import MODES, ONE_RANK, PROMPTS, plain_outputs

from meshserve import LLM, SamplingParams

LENGTHS = [8, 16, 24, 32, 40]
"""Each prompt's max_tokens: the batch shrinks from 5 to 1 as they finish, so steps
cross speculative.max_batch_size=1 from plain (async) to drafting (waited for)."""
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in LENGTHS]
ASYNC = [*ONE_RANK, "engine.async_scheduling=true"]
ASYNC_MODES = {**{m: MODES[m] for m in ("continuous", "chunk-7")},
               "preempt": ["engine.block_size=4", "engine.num_gpu_blocks=24"]}
"""Continuous batching, chunked prefill, and a cache small enough for these shorter
outputs to preempt."""


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return plain_outputs(PARAMS)


def count_launches(llm: LLM) -> list[int]:
    """A counter of the steps the executor launched without waiting."""
    executor, launched = llm.engine.executor, [0]
    launch = executor.launch

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        launched[0] += 1
        return launch(*args, **kwargs)

    executor.launch = counted
    return launched


@pytest.mark.parametrize("mode", ASYNC_MODES)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_plain_steps_run_async_and_drafting_ones_wait(plain, method: str, mode: str) -> None:
    llm = LLM("meshcoder", overrides=[*ASYNC, f"speculative={method}",
                                      "speculative.max_batch_size=1", *ASYNC_MODES[mode]],
              progress=False)
    try:
        assert llm.engine.async_scheduling
        launched = count_launches(llm)
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == plain
        stats = llm.engine.stats
        assert launched[0] > 0 and stats.spec.num_drafts > 0  # both kinds of step ran
        assert stats.spec.num_accepted_tokens > 0
        assert stats.num_free_blocks == llm.engine.num_blocks
        if mode == "preempt":
            assert stats.num_preemptions > 0
    finally:
        llm.shutdown()


def test_the_run_time_switch_under_async_scheduling(plain) -> None:
    llm = LLM("meshcoder", overrides=[*ASYNC, "speculative=draft"], progress=False)
    try:
        launched = count_launches(llm)
        for _ in range(2):  # the switch times both kinds, then keeps choosing
            assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == plain
        switch = llm.engine.scheduler.switch
        assert switch is not None and switch.num_plain_steps > 0
        assert launched[0] > 0
        assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()
