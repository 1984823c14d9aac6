"""Mixture-of-experts families: Qwen3-MoE (softmax top-k routing, SwiGLU experts loaded
from per-expert tensors, dense layers where mlp_only_layers says), Qwen2-MoE (a shared
expert behind a sigmoid gate, qkv biases) and Mixtral (w1/w2/w3 expert names, every layer
MoE, top-k renormalized): greedy tokens and log-probabilities as transformers' in fp32 on
one rank and in a two-stage pipeline; a bf16 run; tensor parallelism refused by name until
the experts shard."""

from __future__ import annotations

import pytest
from helpers.hf_greedy import assert_engine_matches, hf_greedy

from meshserve import LLM, SamplingParams
from meshserve.models.arch import ModelArch

PROMPTS = [[5, 17, 42, 99, 3, 250], [7] * 3 + list(range(20, 40)), [311, 2, 64]]
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
           num_hidden_layers=4, mlp_only_layers=[1], norm_topk_prob=True)


FAMILIES = {
    "qwen3_moe": MOE,
    "qwen2_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=3),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=3),
}


def test_qwen3_moe_layers_follow_mlp_only_layers(make_checkpoint) -> None:
    arch = ModelArch.from_dir(make_checkpoint("qwen3_moe", **MOE))
    assert [arch.is_moe_layer(i) for i in range(4)] == [True, False, True, True]


@pytest.mark.parametrize("layout", [["parallel=single"], ["parallel.pp=2"]],
                         ids=["single", "pp2"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers_fp32(make_checkpoint, hf_reference, family: str,
                                          layout: list[str]) -> None:
    path = make_checkpoint(family, **FAMILIES[family])
    assert_engine_matches(path, [*layout, "model.dtype=float32"], PROMPTS,
                          hf_greedy(hf_reference(path), PROMPTS))


def test_bf16_runs_and_mostly_agrees(make_checkpoint, hf_reference) -> None:
    path = make_checkpoint("qwen3_moe", **MOE)
    want, _ = hf_greedy(hf_reference(path), PROMPTS, max_new_tokens=4)
    llm = LLM(str(path), overrides=["parallel=single", "model.dtype=bfloat16"],
              progress=False)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0,
                                                    ignore_eos=True))
    finally:
        llm.shutdown()
    first = [o.token_ids[0] for o in outs]
    assert sum(a == b[0] for a, b in zip(first, want)) >= 2  # bf16 rounding, random weights


def test_tensor_parallel_is_refused_by_name(make_checkpoint) -> None:
    path = make_checkpoint("qwen3_moe", **MOE)
    with pytest.raises(Exception, match=r"parallel.tp=2.*mixture-of-experts.*parallel.tp=1"):
        LLM(str(path), overrides=["parallel.tp=2", "model.dtype=float32"], progress=False)
