"""Logits and greedy continuations match Hugging Face transformers, family by family."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from meshserve import LLM, SamplingParams
from meshserve.models.attention import AttentionMetadata, PrefillChunk
from meshserve.models.loader import load_model

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "head_dim": 16}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),                                              # GQA 2:1, untied
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),   # MHA, tied
    ("llama", {"num_key_value_heads": 1, "head_dim": 32}),      # MQA, head_dim != hidden/heads
    ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),     # Llama 3.1 rope
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("mistral", {"sliding_window": 12}),                        # window shorter than the prompt
    ("mistral", {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16}),
    ("qwen2", {}),                                              # qkv bias
    ("qwen2", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    ("qwen3", {}),                                              # q/k norms, head_dim 128
    ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}),
    ("qwen3_moe", dict(MOE, norm_topk_prob=True)),              # every layer's MLP experts
    ("qwen3_moe", dict(MOE, mlp_only_layers=[0], num_experts_per_tok=3)),  # a dense layer
    ("qwen2_moe", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48}),    # a gated shared expert
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),  # w1/w2/w3 names
]
IDS = [f"{fam}-{'-'.join(f'{k}' for k in kw) or 'base'}" for fam, kw in CASES]


def paged_logits(path: Path, ids: torch.Tensor, prefill: int, dtype: torch.dtype,
                 block_size: int = 8) -> torch.Tensor:
    """Logits of every position: `prefill` tokens in one chunk, the rest decoded one by one,
    K/V going through a scrambled block table."""
    model = load_model(path, dtype=dtype, progress=False)
    attn = model.attention_layers()[0]
    n_blocks = -(-len(ids) // block_size) + 2
    for a in model.attention_layers():
        shape = (n_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        a.bind_cache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    table = torch.randperm(n_blocks, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(len(ids))
    slots = table[pos // block_size] * block_size + pos % block_size
    empty = torch.zeros(0, 1, dtype=torch.long)
    out = []
    with torch.inference_mode():
        meta = AttentionMetadata(slots[:prefill], 0, empty, torch.zeros(0, dtype=torch.long),
                                 [PrefillChunk(0, prefill, 0, table)])
        hidden, _ = model(ids[:prefill], pos[:prefill], meta)
        out.append(model.compute_logits(hidden))
        for t in range(prefill, len(ids)):
            meta = AttentionMetadata(slots[t:t + 1], 1, table.unsqueeze(0),
                                     torch.tensor([t + 1]), [])
            hidden, _ = model(ids[t:t + 1], pos[t:t + 1], meta)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


@pytest.mark.parametrize(("family", "overrides"), CASES, ids=IDS)
def test_logits_match_transformers_fp32(make_checkpoint, hf_reference, family: str,
                                        overrides: dict[str, Any]) -> None:
    path = make_checkpoint(family, **overrides)
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(1))
    ours = paged_logits(path, ids, prefill=29, dtype=torch.float32)
    with torch.inference_mode():
        ref = hf_reference(path)(ids.unsqueeze(0)).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_close_in_half_precision(make_checkpoint, hf_reference, dtype) -> None:
    path = make_checkpoint("llama")
    ids = torch.randint(0, 320, (24,), generator=torch.Generator().manual_seed(2))
    ours = paged_logits(path, ids, prefill=16, dtype=dtype).float()
    with torch.inference_mode():
        ref = hf_reference(path, dtype)(ids.unsqueeze(0)).logits[0].float()
    # Half precision reorders roundings; compare against the fp32 spread of the logits.
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize(("family", "overrides"), [CASES[0], CASES[2], CASES[5], CASES[7]],
                         ids=[IDS[0], IDS[2], IDS[5], IDS[7]])
def test_greedy_continuations_match_transformers(make_checkpoint, hf_reference, family: str,
                                                 overrides: dict[str, Any]) -> None:
    path = make_checkpoint(family, **overrides)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (int(n),), generator=gen).tolist()
               for n in (1, 5, 17, 33, 48)]
    hf = hf_reference(path)
    expected = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16,
                          do_sample=False)
        expected.append(out[0, len(p):].tolist())
    llm = LLM(str(path), overrides=["engine.block_size=4", "parallel=single"], progress=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
