"""Qwen3 (dense; an RMSNorm over each head's q and k before rotary): greedy tokens and
log-probabilities as transformers' in fp32, on one rank and at tp=2 (the norms' weights,
one per head dimension, on every rank); the fused C decoder, which has no such norms,
declines it."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_greedy import hf_greedy

from meshserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 17, 42, 99, 3, 250], [7] * 3 + list(range(20, 40)), [311, 2, 64]]


@pytest.mark.parametrize("layout", [["parallel=single"], ["parallel.tp=2"]],
                         ids=["single", "tp2"])
def test_greedy_matches_transformers_fp32(make_checkpoint, hf_reference,
                                          layout: list[str]) -> None:
    path = make_checkpoint("qwen3", head_dim=16)
    want_tokens, want_logprobs = hf_greedy(hf_reference(path), PROMPTS)
    llm = LLM(str(path), overrides=[*layout, "model.dtype=float32"], progress=False)
    try:
        if layout == ["parallel=single"]:
            assert llm.engine.executor.worker.runner.fused is None
        outs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == want_tokens
    ours = torch.tensor([[lp for lp, _ in o.logprobs] for o in outs])
    assert (ours - torch.tensor(want_logprobs)).abs().max() < 1e-4
