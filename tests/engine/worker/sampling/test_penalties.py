"""Penalties and logit_bias through the engine, greedy, against transformers: its own
repetition penalty, and a step-by-step reference for presence and frequency penalties."""

from __future__ import annotations

import pytest
import torch

from meshserve import LLM, SamplingParams

ONE_RANK = ["parallel=single"]
MODES = {
    "continuous": [],
    "chunk-7": ["engine.max_num_batched_tokens=7"],
    "preempt": ["engine.block_size=4", "engine.num_gpu_blocks=24"],
    "async": ["engine.async_scheduling=true"],
}
NEW = 12


def reference(hf: torch.nn.Module, prompt: list[int], *, presence: float = 0.0,
              frequency: float = 0.0, repetition: float = 1.0) -> list[int]:
    """Greedy decoding with the penalties applied by hand to transformers' logits."""
    ids, out = list(prompt), []
    for _ in range(NEW):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        for t in set(ids):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= frequency * out.count(t) + presence
        token = int(logits.argmax())
        ids.append(token)
        out.append(token)
    return out


@pytest.fixture(scope="module")
def hf(make_checkpoint, hf_reference) -> torch.nn.Module:
    return hf_reference(make_checkpoint("llama"))


@pytest.mark.parametrize("mode", MODES)
def test_penalties_match_the_reference(make_checkpoint, hf, prompts, mode) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=[*ONE_RANK, *MODES[mode]],
              progress=False)
    kinds = [dict(presence=1.5), dict(frequency=0.7), dict(repetition=1.8),
             dict(presence=0.4, frequency=0.3, repetition=1.2), {}]
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty",
             "repetition": "repetition_penalty"}
    batch, want = [], []
    for i, p in enumerate(prompts[:8]):
        kind = kinds[i % len(kinds)]
        batch.append(SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                                    **{names[k]: v for k, v in kind.items()}))
        want.append(reference(hf, p, **kind))
    outs = llm.generate(prompts[:8], batch)
    assert [o.token_ids for o in outs] == want
    if mode == "continuous":  # the penalties do change the greedy tokens
        changed = [w != reference(hf, p) for p, w, b in zip(prompts, want, batch)
                   if b.penalized]
        assert sum(changed) >= len(changed) - 1, changed
    assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks


def test_transformers_repetition_penalty_agrees(make_checkpoint, hf, prompts) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=ONE_RANK, progress=False)
    sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                        repetition_penalty=1.6)
    outs = llm.generate(prompts[:4], sp)
    for p, o in zip(prompts[:4], outs):
        ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, repetition_penalty=1.6)
        assert o.token_ids == ids[0, len(p):].tolist()


def test_logit_bias_forces_and_bans_tokens(make_checkpoint, prompts) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=ONE_RANK, progress=False)
    forced = llm.generate(prompts[:2], SamplingParams(max_tokens=6, temperature=0.0,
                                                      ignore_eos=True, logit_bias={17: 100}))
    assert all(o.token_ids == [17] * 6 for o in forced)
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True))[0].token_ids
    banned = llm.generate(prompts[:1], SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True,
        logit_bias={t: -100 for t in set(plain)}))[0].token_ids
    assert not set(banned) & set(plain)
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[320\] outside"):
        llm.generate(prompts[:1], SamplingParams(logit_bias={320: 1.0}))


def test_penalties_under_tensor_parallel(make_checkpoint, hf, prompts) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=["parallel.tp=2"], progress=False)
    try:
        sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True,
                            frequency_penalty=0.9, repetition_penalty=1.3)
        outs = llm.generate(prompts[:3], sp)
        assert [o.token_ids for o in outs] == [
            reference(hf, p, frequency=0.9, repetition=1.3) for p in prompts[:3]]
    finally:
        llm.shutdown()
