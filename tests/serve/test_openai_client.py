"""The official `openai` client against a real server: token-identical to the offline API."""

from __future__ import annotations

import random

import openai
import pytest

from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.llm import LLM

MODEL = "meshcoder"
PROMPTS = ["def fibonacci(n):", "import os\n\nclass ", "    def __init__(self,"]
MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": "Sort a list."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60.0)


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_models_retrieve_finds_the_served_model_and_not_another(client: openai.OpenAI) -> None:
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found" and "'gpt-9' is not served" in e.value.message


def test_openai_errors_carry_string_or_null_codes(client: openai.OpenAI) -> None:
    """stream_options without a stream is a 400 naming it, as OpenAI answers."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  stream_options={"include_usage": True})
    assert e.value.param == "stream_options" and e.value.code is None


def test_completions_match_offline_tokens(client: openai.OpenAI, offline: LLM) -> None:
    want = offline.generate(PROMPTS, greedy(12, ignore_eos=True))
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in got.choices] == [0, 1, 2]
    for c, w in zip(got.choices, want):
        assert c.token_ids == w.token_ids  # type: ignore[attr-defined]
        assert c.text == w.text
        assert c.finish_reason == "length"
    assert got.usage is not None
    assert got.usage.completion_tokens == 36
    assert got.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)


def test_streamed_completion_concatenates_to_the_offline_one(client: openai.OpenAI,
                                                             offline: LLM) -> None:
    want = offline.generate([PROMPTS[0]], greedy(10, ignore_eos=True))[0]
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    *deltas, usage = chunks
    assert "".join(c.choices[0].text for c in deltas) == want.text
    assert [t for c in deltas for t in c.choices[0].token_ids] == want.token_ids  # type: ignore[attr-defined]
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == 10


def test_chat_matches_offline_on_the_rendered_template(client: openai.OpenAI,
                                                       offline: LLM) -> None:
    assert offline.tokenizer is not None
    rendered = offline.tokenizer.apply_chat_template(MESSAGES)
    # (the template writes its own BOS: no special tokens added on top)
    want = offline.generate([offline.tokenizer.encode(rendered, add_special_tokens=False)],
                            greedy(12))[0]
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                         max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.token_ids == want.token_ids  # type: ignore[attr-defined]
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES,  # type: ignore[arg-type]
                                            max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_stop_n_seed_and_logprobs(client: openai.OpenAI, offline: LLM) -> None:
    full = offline.generate([PROMPTS[0]], greedy(16, ignore_eos=True))[0].text
    stop = full[3:6]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].text == full[:full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    sampled = [client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, n=2,
                                         temperature=1.0, seed=7, logprobs=2,
                                         extra_body={"ignore_eos": True})
               for _ in range(2)]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    lp = sampled[0].choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == 8 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert all(x <= 0.0 for x in lp.token_logprobs)


def test_streamed_text_equals_non_streamed_for_multi_token_stops(client: openai.OpenAI,
                                                                 offline: LLM) -> None:
    """A stop string spanning several tokens never leaks its start into the stream."""
    full = offline.generate([PROMPTS[1]], greedy(32, ignore_eos=True))[0].text
    rng = random.Random(1)
    for _ in range(12):
        a = rng.randrange(1, len(full) - 8)
        stop = full[a:a + rng.randint(3, 8)]
        kw: dict = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=32, temperature=0,
                        stop=[stop], extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw).choices[0]
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw,
                                                                                 stream=True))
        assert whole.text == streamed == full[:full.index(stop)], stop
        assert whole.finish_reason == "stop"


def test_penalties_and_logit_bias_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    kw = dict(presence_penalty=0.8, frequency_penalty=0.5)
    want = offline.generate(PROMPTS, greedy(16, ignore_eos=True, repetition_penalty=1.3,
                                            min_p=0.1, **kw))
    got = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=16, temperature=0,
                                    **kw, extra_body={"ignore_eos": True, "min_p": 0.1,
                                                      "repetition_penalty": 1.3,
                                                      "return_token_ids": True})
    assert [c.token_ids for c in got.choices] == [w.token_ids for w in want]  # type: ignore[attr-defined]
    plain = offline.generate(PROMPTS, greedy(16, ignore_eos=True))
    assert [w.token_ids for w in want] != [p.token_ids for p in plain]
    token = plain[0].token_ids[0]
    banned = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
        logit_bias={str(token): -100}, extra_body={"return_token_ids": True})
    assert token not in banned.choices[0].token_ids  # type: ignore[attr-defined]


def test_best_of_returns_the_candidates_with_the_highest_logprob(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=5)
    candidates = client.completions.create(**kw, n=4, logprobs=0)
    totals = sorted((sum(c.logprobs.token_logprobs), c.text) for c in candidates.choices)
    best = client.completions.create(**kw, n=2, best_of=4)
    assert [c.text for c in best.choices] == [t for _, t in totals[::-1][:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == candidates.usage.completion_tokens
