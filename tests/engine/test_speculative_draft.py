"""Speculative decoding with a draft model: greedy output identical to plain decoding in
every scheduling mode and under TP, the target as its own draft accepted throughout,
sampled requests verified against their own distributions, and a mismatched draft refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.speculation import (
    GREEDY,
    MODES,
    ONE_RANK,
    PROMPTS,
    check_aborts_give_every_block_back,
    check_counts,
    check_prefix_hits_under_tensor_parallel,
    plain_outputs,
)

from meshserve import LLM, SamplingParams
from meshserve.engine.core.sampling_params import SequenceSampling
from meshserve.engine.worker.sampling.sampler import Sampler
from meshserve.engine.worker.sampling.step_sampler import StepSampler
from meshserve.models.bundled import BUNDLED_DIR

DRAFT = ["speculative=draft", "speculative.max_batch_size=64"]
"""Every step drafts (no run-time switch): the tests check what drafting does."""


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return plain_outputs()



@pytest.mark.parametrize("mode", MODES)
def test_greedy_draft_model_is_token_identical(plain, mode: str) -> None:
    llm = LLM("meshcoder", overrides=[*ONE_RANK, *DRAFT, *MODES[mode]], progress=False)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == plain
        check_counts(llm, outs)
        if mode == "preempt":
            assert llm.engine.stats.num_preemptions > 0
    finally:
        llm.shutdown()


def test_the_target_as_its_own_draft_is_always_accepted(plain) -> None:
    llm = LLM("meshcoder", overrides=[*ONE_RANK, *DRAFT, "speculative.draft_model=meshcoder",
                                      "engine.max_num_batched_tokens=16"], progress=False)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == plain
        spec = llm.engine.stats.spec
        assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens
        check_counts(llm, outs)
    finally:
        llm.shutdown()


def test_prefix_hits_and_tensor_parallel(plain) -> None:
    check_prefix_hits_under_tensor_parallel(DRAFT, plain)


def test_sampled_requests_speculate_and_aborts_give_every_block_back() -> None:
    llm = LLM("meshcoder", overrides=[*ONE_RANK, *DRAFT, "engine.block_size=4"],
              progress=False)
    engine = llm.engine
    try:
        sampled = SamplingParams(max_tokens=30, temperature=0.7, top_k=20, top_p=0.9,
                                 ignore_eos=True)
        outs = llm.generate(PROMPTS, sampled)
        assert all(len(o.token_ids) == 30 for o in outs)
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0
        ids = [engine.add_request(PROMPTS[0], SamplingParams(max_tokens=200, temperature=0.0,
                                                             ignore_eos=True))
               for _ in range(3)]
        for _ in range(8):
            engine.step()
        check_aborts_give_every_block_back(engine, ids[:2])
    finally:
        llm.shutdown()


def test_a_draft_with_another_vocabulary_is_refused_naming_both(tmp_path: Path) -> None:
    bad = tmp_path / "draft"
    shutil.copytree(BUNDLED_DIR / "meshcoder-draft", bad)
    config = json.loads((bad / "config.json").read_text())
    config["vocab_size"] = 4000
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="4000 tokens.*4096"):
        LLM("meshcoder", overrides=[*ONE_RANK, *DRAFT, f"speculative.draft_model={bad}"],
            progress=False)
    with pytest.raises(ValueError, match="speculative.draft_model='nope'"):
        LLM("meshcoder", overrides=[*ONE_RANK, *DRAFT, "speculative.draft_model=nope"],
            progress=False)


@pytest.mark.parametrize("draft_model", [True, False], ids=["draft-model", "ngram"])
def test_verified_tokens_follow_the_processed_target_distribution(draft_model: bool) -> None:
    """Through the worker's sampler: with temperature, top-k and top-p on both sides, the
    first token a verify step emits is distributed as the target's processed
    distribution, whatever the drafts (drawn from the draft's, or fixed)."""
    vocab, k, n = 6, 2, 20000
    g = torch.Generator().manual_seed(3)
    target = torch.randn(k + 1, vocab, generator=g) * 2
    draft = torch.randn(k, vocab, generator=g) * 2
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.9, max_tokens=8)
    sampler = StepSampler(torch.device("cpu"), 0, vocab)
    sampler.track({i: SequenceSampling(params) for i in range(n)}, [])
    q = Sampler().probs(draft, [params] * k)
    drafts: dict[int, list[int]] = {}
    probs: dict[int, torch.Tensor] = {}
    for i in range(n):
        drafts[i] = ([int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
                     if draft_model else [1, 2])
        if draft_model:
            probs[i] = q
    logits = target.repeat(n, 1)
    seq_ids = [i for i in range(n) for _ in range(k + 1)]
    out = sampler.launch(logits, seq_ids, drafts, probs or None)
    first = [out.accepted[i][0] if out.accepted[i] else t
             for i, t in zip(out.seq_ids, out.tokens.tolist())]
    freq = torch.bincount(torch.tensor(first), minlength=vocab) / n
    want = Sampler().probs(target[:1], [params])[0]
    assert torch.allclose(freq, want, atol=0.012), (freq, want)
    assert (freq[want == 0] == 0).all()  # never a token top-k or top-p cut


def test_above_max_batch_size_no_draft_forward_runs() -> None:
    llm = LLM("meshcoder", overrides=[*ONE_RANK, "speculative=draft", "speculative.max_batch_size=1"],
              progress=False)
    engine = llm.engine
    drafter = engine.executor.worker.drafter
    try:
        longer = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(p, GREEDY) for p in PROMPTS[1:]]
        ids.append(engine.add_request(PROMPTS[0], longer))
        engine.step()  # admits them all: nothing ran before, so the draft runs the prompts
        before, steps = drafter.num_forwards, 0
        while engine.stats.num_running > 1:
            engine.step()
            steps += 1
        assert steps > 0 and drafter.num_forwards == before  # plain steps: no draft forward
        assert engine.stats.spec.num_draft_tokens == 0
        while engine.has_unfinished():  # one left: it drafts, catching up what it lags by
            engine.step()
        assert drafter.num_forwards > before and engine.stats.spec.num_accepted_tokens > 0
        assert engine.stats.num_free_blocks == engine.num_blocks
        assert len(ids) == len(PROMPTS)
    finally:
        llm.shutdown()


def test_runs_end_at_an_unsure_draft_and_the_rest_is_not_verified(plain) -> None:
    llm = LLM("meshcoder", overrides=[*ONE_RANK, *DRAFT, "speculative.stop_confidence=0.9"],
              progress=False)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == plain
        spec = llm.engine.stats.spec
        assert spec.num_drafts <= spec.num_draft_tokens < 4 * spec.num_drafts  # shorter runs
        assert sum(o.metrics.num_draft_tokens for o in outs) == spec.num_draft_tokens
        assert llm.engine.stats.num_free_blocks == llm.engine.num_blocks
    finally:
        llm.shutdown()


def test_greedy_drafts_in_one_c_call_are_the_modules_drafts(monkeypatch) -> None:
    """On the CPU a fused draft model's greedy drafts run in one C call: the whole
    proposal where every feed is decode rows, else the lean steps after the modules' first
    forward (prompt chunks in the step: chunked prefill). Either way they are exactly what
    its module-by-module steps draft, rows ending at their own lengths."""
    from meshserve.engine.worker.draft_proposer import DraftProposer
    from meshserve.models.fused_decoder import FusedDecoder

    made: list[dict[int, list[int]]] = []
    propose = DraftProposer.propose
    monkeypatch.setattr(DraftProposer, "propose",
                        lambda self, s: made.append((out := propose(self, s)).tokens) or out)
    calls: list[bool] = []  # per C call: whether it fed the catch-up rows too
    fused = FusedDecoder.draft_greedy
    monkeypatch.setattr(FusedDecoder, "draft_greedy", lambda self, *a: calls.append(
        len(a) > 5 and a[5] is not None) or fused(self, *a))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
              for n in (9, 14, 23, 40, 6)]  # runs near their ends draft fewer
    runs = []
    for c_calls in (True, False):
        if not c_calls:
            monkeypatch.setattr(FusedDecoder, "drafts_greedy", lambda *a: False)
        for mode in ("continuous", "chunk-7"):
            made.clear()
            calls.clear()
            llm = LLM("meshcoder", overrides=[*ONE_RANK, *DRAFT, *MODES[mode]], progress=False)
            try:
                outs = llm.generate(PROMPTS, params)
            finally:
                llm.shutdown()
            runs.append(([o.token_ids for o in outs], [m for m in made if m]))
            if c_calls:
                assert set(calls) == ({True} if mode == "continuous" else {True, False})
            else:
                assert not calls
    assert runs[:2] == runs[2:]
    assert any(len(set(map(len, step.values()))) > 1 for step in runs[0][1])
