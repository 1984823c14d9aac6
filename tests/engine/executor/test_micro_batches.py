"""The engine with micro-batches in flight, without spawning ranks.

`InOrderPipeline` (tests/helpers/pipeline.py) runs each micro-batch in order, as every stage
of a real pipeline does, so greedy outputs must equal transformers' exactly.
"""

from __future__ import annotations

import pytest
from helpers.pipeline import InOrderPipeline

from meshserve import SamplingParams
from meshserve.engine.config.run import resolve_run
from meshserve.engine.config.runtime_config import RuntimeConfig
from meshserve.engine.core.micro_batch import micro_batch_budget, micro_batch_cap
from meshserve.engine.engine import Engine
from meshserve.engine.executor.executor import InProcessExecutor
from meshserve.engine.llm import model_overrides
from meshserve.launch.cli_config import load_config

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def local_executor(config: RuntimeConfig) -> InProcessExecutor:
    return InProcessExecutor(resolve_run(config, env=None), progress=False)


def run(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    return [done[i] for i in ids]


MODES = {
    "continuous": [],
    "preempt": ["engine.block_size=4", "engine.num_gpu_blocks=24"],
    "chunk-16-preempt": ["engine.block_size=4", "engine.num_gpu_blocks=28",
                         "engine.max_num_batched_tokens=16"],
}


@pytest.mark.parametrize(("mode", "num_in_flight"), [
    ("continuous", 2), ("continuous", 3), ("preempt", 2), ("chunk-16-preempt", 3)])
def test_micro_batches_give_the_same_tokens(make_checkpoint, prompts, expected, mode: str,
                                            num_in_flight: int) -> None:
    config = load_config(model_overrides(str(make_checkpoint("llama"))) + MODES[mode])
    pipeline = InOrderPipeline(local_executor(config), num_in_flight)
    engine = Engine(config, progress=False, executor=pipeline)
    assert run(engine, prompts) == expected
    assert max(n for _, n in pipeline.batches) == num_in_flight - 1  # the pipeline filled
    stats = engine.stats
    assert stats.num_free_blocks == engine.num_blocks and stats.num_in_flight == 0
    if "preempt" in mode:
        assert stats.num_preemptions > 0
    if mode == "continuous":  # the first micro-batches share the prompts' tokens evenly,
        # except the rest of a prompt split at a boundary: that one is in flight already.
        share = -(-sum(len(p) for p in prompts) // num_in_flight)
        first = [t for t, _ in pipeline.batches[:num_in_flight]]
        assert first[0] == share
        assert all(0 <= share - t < max(len(p) for p in prompts) for t in first), first
    if "preempt" not in mode:  # a small cache keeps no prefix long enough to hit
        assert run(engine, prompts) == expected  # again, now with prefix-cache hits
        assert engine.stats.prefix_cache.num_hits > 0


def test_alternating_groups_stay_balanced(make_checkpoint, prompts) -> None:
    """Sequences finish at different steps; the two groups that alternate through a
    two-stage pipeline stay within two sequences of each other (before the budget counted
    the group in flight, they went 2 and 8 here; in the longtail benchmark 1 and 5)."""
    config = load_config(model_overrides(str(make_checkpoint("llama"))))
    pipeline = InOrderPipeline(local_executor(config), 2)
    engine = Engine(config, progress=False, executor=pipeline)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=4 + 3 * (i % 5) + 6 * (i // 5),
                                             temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    sizes = pipeline.decodes[2:]  # from the first decode-only pair on (the old budget:
    assert len(sizes) > 20         # 2, 8, 2, 8, 2, 7, ...; now 5, 4, 5, 4, ...)
    assert max(abs(a - b) for a, b in zip(sizes, sizes[1:])) <= 2, pipeline.decodes


def test_aborting_a_sequence_in_flight(make_checkpoint, prompts, expected) -> None:
    config = load_config(model_overrides(str(make_checkpoint("llama"))))
    pipeline = InOrderPipeline(local_executor(config), 2)
    engine = Engine(config, progress=False, executor=pipeline)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:4]]
    while not pipeline.in_flight:  # until a step leaves a micro-batch in the pipeline
        assert not any(o.finished for o in engine.step())
    victim = next(r for r in ids if int(r) in pipeline.in_flight)
    assert engine.abort(victim)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id != victim
            done[o.request_id] = o.token_ids
    assert [done[i] for i in ids if i != victim] == \
        [e for i, e in zip(ids, expected[:4]) if i != victim]
    assert engine.stats.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize(("pending", "returning", "slots", "cap", "budget"), [
    (248, 0, 2, 2048, 124), (249, 0, 2, 2048, 125), (10, 0, 3, 2048, 4),
    (5000, 0, 2, 2048, 2048), (0, 0, 2, 2048, 1), (3, 0, 2, 2048, 2), (1, 0, 1, 7, 1),
    (5, 1, 2, 2048, 3),  # a group of 5 ready, 1 in flight: 3 now, 2 wait for the next
    (1, 5, 2, 2048, 3),  # the small group takes what it has (the scheduler stops there)
    (900, 3000, 2, 2048, 1950), (6, 2, 3, 2048, 3),
])
def test_micro_batch_budget(pending: int, returning: int, slots: int, cap: int,
                            budget: int) -> None:
    assert micro_batch_budget(pending, returning, slots, cap) == budget


@pytest.mark.parametrize(("step", "slots", "device", "configured", "cap"), [
    (2048, 2, "cpu", None, 512),   # a CPU pipeline: the step budget over twice the slots
    (2048, 4, "cpu", None, 256),
    (2048, 8, "cpu", None, 256),   # never below 256
    (200, 2, "cpu", None, 200),    # nor above the step budget
    (2048, 1, "cpu", None, 2048),  # no pipeline
    (2048, 2, "cuda", None, 2048),  # GPUs keep the step budget
    (2048, 2, "cpu", 1024, 1024), (2048, 2, "cuda", 300, 300),
    (2048, 2, "cpu", 4096, 2048),  # configured, within the step budget
])
def test_micro_batch_cap(step: int, slots: int, device: str, configured: int | None,
                         cap: int) -> None:
    assert micro_batch_cap(step, slots, device, configured) == cap


def test_micro_batch_tokens_is_validated() -> None:
    from meshserve.parallel.parallel_config import ParallelConfig

    assert ParallelConfig(micro_batch_tokens=512).micro_batch_tokens == 512
    with pytest.raises(ValueError, match=r"parallel.micro_batch_tokens=0 is invalid.*"
                                         r"null or an int >= 1"):
        ParallelConfig(micro_batch_tokens=0)
