"""Async scheduling on a GPU: decode steps under CUDA graphs fed tokens the host has not
read yet give the same outputs as the step-by-step engine."""

from __future__ import annotations

import pytest
import torch

from meshserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA_FP32 = ["parallel=single", "device=cuda", "model.dtype=float32", "engine.num_gpu_blocks=256"]


@pytest.mark.parametrize("extra", [[], ["engine.block_size=4", "engine.num_gpu_blocks=24"]])
def test_async_matches_sync_on_cuda(make_checkpoint, prompts, extra) -> None:
    path = str(make_checkpoint("llama"))
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    outs = {}
    for mode in ("false", "true"):
        llm = LLM(path, overrides=[*CUDA_FP32, f"engine.async_scheduling={mode}", *extra],
                  progress=False)
        assert llm.engine.async_scheduling is (mode == "true")
        outs[mode] = [[o.token_ids for o in llm.generate(prompts, p)] for p in (greedy, seeded)]
        assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks
    assert outs["true"] == outs["false"]


def test_async_is_the_cuda_default(make_checkpoint) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=["parallel=single", "device=cuda", "engine.num_gpu_blocks=64"],
              progress=False)
    assert llm.engine.async_scheduling
