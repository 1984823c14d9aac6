"""model.cpu_weight_dtype=bfloat16: an fp32 model whose packed weights hold bf16, end to end
against transformers with the same weights rounded; every path that reads them."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_greedy import hf_greedy

from meshserve import LLM, SamplingParams
from meshserve.kernels import dispatch, native_cpu
from meshserve.models.model_config import ModelConfig

pytestmark = pytest.mark.skipif(native_cpu.library() is None, reason="no C compiler")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
BF16 = ["parallel=single", "model.cpu_weight_dtype=bfloat16"]
MODES = {
    "continuous": [],
    "chunk-7": ["engine.max_num_batched_tokens=7"],
    "two-threads": ["threads=2"],  # the packed linear split over threads
}


def rounded_like_meshserve(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' model with every weight meshserve packs (the linears, the LM head, and
    the embedding where the head is tied to it) rounded to bf16 and back."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and ("embed_tokens" not in name or model.config.tie_word_embeddings):
                p.copy_(p.to(torch.bfloat16).float())
    return model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_bf16_weights_match_transformers_with_the_same_rounding(
        make_checkpoint, hf_reference, prompts, mode: str, tied: bool) -> None:
    path = make_checkpoint("llama", tie_word_embeddings=tied)
    want_tokens, want_logprobs = hf_greedy(rounded_like_meshserve(hf_reference(path)), prompts)
    llm = LLM(str(path), overrides=[*BF16, *MODES[mode]], progress=False)
    worker = llm.engine.executor.worker  # bf16 panels, decode steps in the fused call
    assert worker.model.model.layers["0"].self_attn.qkv_proj.weight.dtype is torch.bfloat16
    assert worker.runner.fused is not None and worker.runner.fused.weight_dtype is torch.bfloat16
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want_tokens
    ours = torch.tensor([[lp for lp, _ in o.logprobs] for o in outs])
    assert (ours - torch.tensor(want_logprobs)).abs().max() < 1e-4
    assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks


def test_bf16_weights_hold_half_the_bytes(make_checkpoint) -> None:
    """Each weight is held once: 2 bytes a parameter in bf16 (pair panels, N padded to 16
    columns), 4 in fp32 (panels, N padded to 24), and nothing else beside the panels."""
    path = str(make_checkpoint("llama"))
    for dtype, size, cols in (("float32", 4, native_cpu.PANEL), ("bfloat16", 2, 16)):
        llm = LLM(path, overrides=["parallel=single", f"model.cpu_weight_dtype={dtype}"],
                  progress=False)
        model = llm.engine.executor.worker.model
        packed = [p for p in model.parameters() if p.dim() == 3]
        assert packed
        for p in packed:
            n, k = dispatch.packed_columns(p), native_cpu.packed_k(p)
            assert n is not None
            assert p.numel() * p.element_size() == size * -(-n // cols) * cols * k
            assert all(not isinstance(v, torch.Tensor) for v in vars(p).values())


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"model.cpu_weight_dtype.*float16.*bfloat16"):
        ModelConfig(cpu_weight_dtype="float16")
    with pytest.raises(ValueError, match=r"model.cpu_weight_dtype.*cpu_weight_layout=column"):
        ModelConfig(cpu_weight_dtype="bfloat16", cpu_weight_layout="column")


def test_a_draft_model_over_bf16_weights_is_lossless(monkeypatch) -> None:
    """Target and draft both on bf16 panels: the draft's greedy proposals run in the fused
    C call, and the output is plain decoding's over the same weights."""
    from helpers.speculation import PROMPTS

    from meshserve.models.fused_decoder import FusedDecoder

    calls: list[int] = []
    fused = FusedDecoder.draft_greedy
    monkeypatch.setattr(FusedDecoder, "draft_greedy",
                        lambda self, *a: calls.append(1) or fused(self, *a))
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = []
    for spec in ([], ["speculative=draft", "speculative.max_batch_size=64"]):
        llm = LLM("meshcoder", overrides=[*BF16, *spec], progress=False)
        try:
            outs.append([o.token_ids for o in llm.generate(PROMPTS, sampling)])
            if spec:
                assert llm.engine.stats.spec.num_accepted_tokens > 0
        finally:
            llm.shutdown()
    assert outs[0] == outs[1] and calls


def test_the_reference_kernels_widen_bf16_panels_in_torch(monkeypatch) -> None:
    """A packed bf16 weight under the reference kernels (dispatch's fallback): the same
    product as the C kernel's, computed by torch on the widened weight."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.nn.Parameter(torch.randn(50, 40, generator=gen), requires_grad=False)
    x = torch.randn(3, 40, generator=gen)
    dispatch.pack_weight(weight, torch.bfloat16)
    native = dispatch.linear(x, weight)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    dispatch.kernel_mode.cache_clear()
    try:
        reference = dispatch.linear(x, weight)
        rows = dispatch.embedding(torch.tensor([0, 49]), weight)
    finally:
        monkeypatch.delenv(dispatch.ENV_VAR)
        dispatch.kernel_mode.cache_clear()
    torch.testing.assert_close(reference, native, atol=1e-5, rtol=1e-5)
    assert rows.dtype is torch.float32
    assert torch.equal(rows, native_cpu.unpack(weight.data, 50).float()[[0, 49]])
