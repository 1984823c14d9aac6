"""Qwen3 (dense; an RMSNorm over each head's q and k before rotary): greedy tokens and
log-probabilities as transformers' in fp32, on one rank and at tp=2 (the norms' weights,
one per head dimension, on every rank); the fused C decoder, which has no such norms,
declines it."""

from __future__ import annotations

import pytest
from helpers.hf_greedy import assert_engine_matches, hf_greedy

from meshserve import LLM

PROMPTS = [[5, 17, 42, 99, 3, 250], [7] * 3 + list(range(20, 40)), [311, 2, 64]]


@pytest.mark.parametrize("layout", [["parallel=single"], ["parallel.tp=2"]],
                         ids=["single", "tp2"])
def test_greedy_matches_transformers_fp32(make_checkpoint, hf_reference,
                                          layout: list[str]) -> None:
    path = make_checkpoint("qwen3", head_dim=16)
    assert_engine_matches(path, [*layout, "model.dtype=float32"], PROMPTS,
                          hf_greedy(hf_reference(path), PROMPTS))


def test_the_fused_decoder_declines_q_k_norms(make_checkpoint) -> None:
    llm = LLM(str(make_checkpoint("qwen3", head_dim=16)),
              overrides=["parallel=single", "model.dtype=float32"], progress=False)
    try:
        assert llm.engine.executor.worker.runner.fused is None
    finally:
        llm.shutdown()
