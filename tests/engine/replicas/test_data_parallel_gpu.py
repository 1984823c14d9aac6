"""Self-spawned replicas on one node's GPUs: each replica on GPUs of its own, replica 0
(stepped from a thread of the front) on the first; the tokens of one engine; more
replicas than GPUs refused at start-up."""

from __future__ import annotations

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.engine.replicas.data_parallel import DataParallelEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = ["parallel=single", "device=cuda", "model.dtype=float32", "engine.num_gpu_blocks=64"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_replicas_take_gpus_of_their_own(make_checkpoint, prompts) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    path = str(make_checkpoint("llama"))
    with LLM(path, overrides=CUDA, progress=False) as llm:
        single = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    torch.cuda.mem_get_info(1)  # (this process's context on GPU 1 first, then measure)
    free_before = torch.cuda.mem_get_info(1)[0]
    with LLM(path, overrides=[*CUDA, "parallel.dp=2", "engine.num_gpu_blocks=null",
                              "engine.gpu_memory_utilization=0.5"], progress=False) as llm:
        engine = llm.engine
        assert isinstance(engine, DataParallelEngine) and engine.device == torch.device("cuda", 0)
        # replica 1's process took half of GPU 1 for its KV cache, not of GPU 0
        assert free_before - torch.cuda.mem_get_info(1)[0] > 0.3 * free_before
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == single
        assert sorted({o.replica for o in outs}) == [0, 1]


def test_more_replicas_than_gpus_is_refused(make_checkpoint) -> None:
    n = torch.cuda.device_count()
    with pytest.raises(ValueError, match=rf"parallel.dp: {n + 1} replicas .* need {n + 1} GPUs"):
        LLM(str(make_checkpoint("llama")), overrides=[*CUDA, f"parallel.dp={n + 1}"],
            progress=False)
