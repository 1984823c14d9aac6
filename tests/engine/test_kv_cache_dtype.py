"""engine.kv_cache_dtype: an fp32 model over a bf16 KV cache, end to end against
transformers with its K and V rounded the same way; the cache's size; bad values."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers.hf_greedy import hf_greedy

from meshserve import LLM, SamplingParams
from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.config.run import kv_cache_dtype, resolve_run
from meshserve.engine.config.runtime_config import load_runtime_config

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
ONE_RANK = ["parallel=single", "model.dtype=float32"]  # fp32 activations, a bf16 cache
MODES = {
    "continuous": [],
    "chunk-7": ["engine.max_num_batched_tokens=7"],
    "preempt": ["engine.block_size=4", "engine.num_gpu_blocks=24"],
}


@contextmanager
def kv_rounded_to_bf16(model: torch.nn.Module) -> Iterator[None]:
    """transformers' Llama with each layer's K (after rotary, as a cache stores it) and V
    rounded to bf16 and back."""
    from transformers.models.llama import modeling_llama

    rotate = modeling_llama.apply_rotary_pos_emb

    def rotate_then_round(q, k, *args, **kwargs):  # type: ignore[no-untyped-def]
        q, k = rotate(q, k, *args, **kwargs)
        return q, k.to(torch.bfloat16).to(k.dtype)

    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda _m, _i, out: out.to(torch.bfloat16).to(out.dtype))
        for layer in model.model.layers]
    modeling_llama.apply_rotary_pos_emb = rotate_then_round
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = rotate
        for h in hooks:
            h.remove()


@pytest.fixture(scope="module")
def hf_runs(make_checkpoint, hf_reference, prompts) -> dict[str, tuple]:
    """transformers' greedy tokens and log-probabilities, K/V in fp32 and rounded to bf16."""
    model = hf_reference(make_checkpoint("llama"))
    full = hf_greedy(model, prompts)
    with kv_rounded_to_bf16(model):
        rounded = hf_greedy(model, prompts)
    return {"float32": full, "bfloat16": rounded}


@pytest.mark.parametrize("mode", MODES)
def test_a_bf16_cache_matches_transformers_with_its_kv_rounded(make_checkpoint, prompts,
                                                               hf_runs, mode: str) -> None:
    """Same greedy tokens, and log-probabilities within fp32 noise of transformers with K/V
    rounded to bf16, further from the unrounded ones: the cache's rounding is all that
    changed, on every path (prefill, chunked prefill, prefix hits, decodes, preemption)."""
    llm = LLM(str(make_checkpoint("llama")), progress=False,
              overrides=[*ONE_RANK, "engine.kv_cache_dtype=bfloat16", *MODES[mode]])
    outs = llm.generate(prompts, GREEDY)
    want_tokens, want_logprobs = hf_runs["bfloat16"]
    assert [o.token_ids for o in outs] == want_tokens
    ours = torch.tensor([[lp for lp, _ in o.logprobs] for o in outs])
    rounded, full = torch.tensor(want_logprobs), torch.tensor(hf_runs["float32"][1])
    assert (ours - rounded).abs().max() < 1e-4
    assert (ours - full).abs().max() > 10 * (ours - rounded).abs().max()
    assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks  # nothing leaked
    if mode == "preempt":
        assert llm.engine.stats.num_preemptions > 0


def test_a_bf16_cache_holds_twice_the_blocks(make_checkpoint) -> None:
    path = str(make_checkpoint("llama"))
    budget = ["engine.kv_cache_memory=1048576"]
    full = LLM(path, overrides=[*ONE_RANK, *budget], progress=False)
    half = LLM(path, overrides=[*ONE_RANK, *budget, "engine.kv_cache_dtype=bfloat16"],
               progress=False)
    assert half.engine.num_blocks == 2 * full.engine.num_blocks


def test_a_bad_cache_dtype_names_the_field_and_what_is_allowed() -> None:
    with pytest.raises(ValueError, match=r"engine.kv_cache_dtype.*fp8.*bfloat16"):
        EngineConfig(kv_cache_dtype="fp8")


def test_a_gpu_takes_only_the_models_dtype(make_checkpoint: Path) -> None:
    """GPU attention reads the model's dtype: another cache dtype there is refused, by name."""
    def run(kv: str, device: str):  # type: ignore[no-untyped-def]
        config = load_runtime_config(
            [f"model.path={make_checkpoint('llama')}", *ONE_RANK, f"engine.kv_cache_dtype={kv}"])
        return dataclasses.replace(resolve_run(config, env=None, announce=False),
                                   device_type=device)

    assert kv_cache_dtype(run("bfloat16", "cpu")) is torch.bfloat16
    assert kv_cache_dtype(run("auto", "cuda")) is torch.float32  # the checkpoint's dtype
    assert kv_cache_dtype(run("float32", "cuda")) is torch.float32
    with pytest.raises(ValueError, match=r"engine.kv_cache_dtype=bfloat16.*float32.*cuda"):
        kv_cache_dtype(run("bfloat16", "cuda"))
