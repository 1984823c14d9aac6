"""The offline API end to end: token-identical to transformers under every scheduling
mode, sampling reproducibility, stop conditions, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ONE_RANK = ["parallel=single"]  # these check the engine; parallel=auto is tested on its own


MODES = {
    "continuous": [],
    "static": ["engine=static", "engine.static_batch_size=3"],
    "no-prefix-cache": ["engine.enable_prefix_caching=false"],
    "chunk-7": ["engine.max_num_batched_tokens=7"],
    "chunk-32": ["engine.max_num_batched_tokens=32", "engine.max_num_seqs=4"],
    "preempt": ["engine.block_size=4", "engine.num_gpu_blocks=24"],
    "no-chunking": ["engine.enable_chunked_prefill=false", "engine.max_num_batched_tokens=64"],
    "async": ["engine.async_scheduling=true"],
    "async-chunk-7": ["engine.async_scheduling=true", "engine.max_num_batched_tokens=7"],
    "async-preempt": ["engine.async_scheduling=true", "engine.block_size=4",
                      "engine.num_gpu_blocks=24"],
    "async-static": ["engine.async_scheduling=true", "engine=static",
                     "engine.static_batch_size=3"],
}
ASYNC = {"sync": [], "async": ["engine.async_scheduling=true"]}
"""Scheduling each step after the previous one is resolved, or before (overlapped)."""


@pytest.mark.parametrize("mode", MODES)
def test_greedy_identical_to_transformers(make_checkpoint, prompts, expected, mode) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=[*ONE_RANK, *MODES[mode]],
              progress=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats
    if mode.endswith("preempt"):
        assert stats.num_preemptions > 0
    assert stats.num_free_blocks == llm.engine.num_blocks  # nothing leaked


def test_prefix_cache_hits_and_same_output(make_checkpoint, prompts, expected) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=[*ONE_RANK, "engine.block_size=4"],
              progress=False)
    first = llm.generate(prompts, GREEDY)
    again = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in again] == [o.token_ids for o in first] == expected
    cached = [o.metrics.num_cached_tokens for o in again]
    assert cached == [((len(p) - 1) // 4) * 4 for p in prompts]


@pytest.mark.parametrize("sched", ASYNC)
def test_seeded_sampling_is_reproducible(make_checkpoint, prompts, sched) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=[*ONE_RANK, *ASYNC[sched]], progress=False)
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    a = llm.generate(prompts[:4], sp)
    b = llm.generate(prompts[2:3], sp)  # alone, with a different batch around it
    assert a[2].token_ids == b[0].token_ids
    other = llm.generate(prompts[2:3], SamplingParams(max_tokens=10, temperature=1.0, seed=7,
                                                       ignore_eos=True))
    assert other[0].token_ids != a[2].token_ids


@pytest.mark.parametrize("sched", ASYNC)
def test_stop_token_and_min_tokens(make_checkpoint, prompts, expected, sched) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=[*ONE_RANK, *ASYNC[sched]], progress=False)
    stop_at = expected[5][4]
    first_hit = expected[5].index(stop_at)
    out = llm.generate([prompts[5]], SamplingParams(max_tokens=12, temperature=0.0,
                                                    stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == expected[5][:first_hit + 1]
    out = llm.generate([prompts[5]], SamplingParams(max_tokens=12, temperature=0.0,
                                                    stop_token_ids=[stop_at],
                                                    min_tokens=first_hit + 2))[0]
    assert out.token_ids[:first_hit + 2] == expected[5][:first_hit + 2]
    assert len(out.token_ids) > first_hit + 1


@pytest.mark.parametrize("sched", ASYNC)
def test_text_prompts_stop_strings_and_logprobs(text_checkpoint: Path, sched: str) -> None:
    llm = LLM(str(text_checkpoint), overrides=[*ONE_RANK, *ASYNC[sched]], progress=False)
    full = llm.generate("def add(a, b):", SamplingParams(max_tokens=24, temperature=0.0,
                                                         ignore_eos=True))[0]
    assert full.text == llm.tokenizer.decode(full.token_ids)
    stop = full.text[5:8]
    cut = llm.generate("def add(a, b):", SamplingParams(max_tokens=24, temperature=0.0,
                                                        ignore_eos=True, stop=[stop],
                                                        logprobs=2))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.find(stop)]
    assert cut.logprobs is not None and len(cut.logprobs) == len(cut.token_ids)
    assert all(len(top) == 2 and lp <= 0 for lp, top in cut.logprobs)


@pytest.mark.parametrize(("prompt", "match"), [
    ([], r"^prompt: empty"),
    ([1, 2, 320], r"^prompt_token_ids: \[320\] outside the vocabulary"),
    ([-1], r"^prompt_token_ids: \[-1\] outside the vocabulary"),
    (list(range(256)), r"^prompt: 256 tokens; allowed is fewer than max_model_len=256"),
])
def test_bad_prompts_raise_and_the_rest_still_run(make_checkpoint, prompts, expected, prompt,
                                                  match) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=ONE_RANK, progress=False)
    engine = llm.engine
    good = engine.add_request(prompts[3], GREEDY)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="^top_p="):
        engine.add_request(prompts[0], SamplingParams(top_p=2.0))
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            done[o.request_id] = o
    assert done[good].token_ids == expected[3]
    assert engine.stats.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("sched", ASYNC)
def test_abort_frees_blocks(make_checkpoint, prompts, sched) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=[*ONE_RANK, *ASYNC[sched]], progress=False)
    engine = llm.engine
    rid = engine.add_request(prompts[-1], GREEDY)
    keep = engine.add_request(prompts[-2], GREEDY)
    engine.step()
    assert engine.abort(rid) and not engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_free_blocks == engine.num_blocks
    assert keep not in engine._by_request_id


def test_async_scheduling_refuses_a_pipeline(make_checkpoint) -> None:
    with pytest.raises(ValueError, match=r"^engine.async_scheduling=true with parallel.pp=2"):
        LLM(str(make_checkpoint("llama")), overrides=["parallel.pp=2",
                                                      "engine.async_scheduling=true"],
            progress=False)


def test_async_scheduling_is_off_on_cpu_by_default(make_checkpoint) -> None:
    llm = LLM(str(make_checkpoint("llama")), overrides=ONE_RANK, progress=False)
    assert not llm.engine.async_scheduling
