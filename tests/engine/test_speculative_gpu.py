"""Speculative decoding on a GPU: in float32, with CUDA graphs for the target's and the
draft's decode steps and async scheduling, greedy drafts (n-gram and the bundled draft
model) change no token in any scheduling mode, seeded sampling does not depend on the
engine's scheduling, and every KV block comes back."""

from __future__ import annotations

import pytest
import torch
from helpers.speculation import GREEDY, MODES, PROMPTS

from meshserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA_FP32 = ["parallel=single", "device=cuda", "model.dtype=float32", "engine.num_gpu_blocks=256"]
SEEDED = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
GPU_MODES = {m: MODES[m] for m in ("continuous", "chunk-7", "preempt")}


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM("meshcoder", overrides=CUDA_FP32, progress=False)
    try:
        assert llm.engine.async_scheduling
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", GPU_MODES)
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_is_token_identical_on_cuda(plain, method: str, mode: str) -> None:
    llm = LLM("meshcoder", overrides=[*CUDA_FP32, f"speculative={method}",
                                      "speculative.max_batch_size=64", *GPU_MODES[mode]],
              progress=False)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == plain
        stats = llm.engine.stats
        assert stats.spec.num_accepted_tokens > 0
        assert stats.num_free_blocks == llm.engine.num_blocks
        if mode == "preempt":
            assert stats.num_preemptions > 0
    finally:
        llm.shutdown()


def test_seeded_draft_sampling_is_the_same_alone_and_batched() -> None:
    llm = LLM("meshcoder", overrides=[*CUDA_FP32, "speculative=draft",
                                      "speculative.max_batch_size=64"], progress=False)
    try:
        batched = [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]
        alone = [llm.generate([p], SEEDED)[0].token_ids for p in PROMPTS[:2]]
        assert alone == batched[:2]
        assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_plain_steps_stay_async_beside_drafting_ones_on_cuda(method: str) -> None:
    """Prompts of different lengths: the batch shrinks to max_batch_size=1, so plain
    steps (scheduled while the step before runs) and drafting ones (waited for) alternate."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (8, 16, 24, 32, 40)]
    ref = LLM("meshcoder", overrides=CUDA_FP32, progress=False)
    try:
        want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    finally:
        ref.shutdown()
    llm = LLM("meshcoder", overrides=[*CUDA_FP32, f"speculative={method}",
                                      "speculative.max_batch_size=1"], progress=False)
    try:
        assert llm.engine.async_scheduling
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
        stats = llm.engine.stats
        assert stats.spec.num_drafts > 0
        assert stats.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()
