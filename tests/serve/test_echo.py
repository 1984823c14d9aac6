"""`/v1/completions` with echo, as evaluation harnesses call it (lm-evaluation-harness's
local-completions: token-id prompts, `echo: true, logprobs: 1, max_tokens: 1`): the prompt
comes back before the completion, with each prompt token's log-prob, equal to
transformers' log_softmax on the same model."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from meshserve.models.bundled import BUNDLED_DIR

PROMPTS = ["def fibonacci(n):\n    return n", "import os\n\nclass Point:"]
TOLERANCE = 0.05


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=60.0)


@pytest.fixture(scope="module")
def hf() -> tuple[object, torch.nn.Module]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(BUNDLED_DIR / "meshcoder"),
            AutoModelForCausalLM.from_pretrained(BUNDLED_DIR / "meshcoder", dtype=torch.float32))


def reference(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf[1](torch.tensor([ids])).logits[0].log_softmax(-1)


def test_echo_scores_every_prompt_token_as_transformers(client: openai.OpenAI, hf) -> None:
    ids = [hf[0](p)["input_ids"] for p in PROMPTS]
    resp = client.completions.create(model="meshcoder", prompt=ids, echo=True, logprobs=2,
                                     max_tokens=1, temperature=0.0)
    for choice, prompt_ids, text in zip(resp.choices, ids, PROMPTS):
        lps = choice.logprobs
        assert choice.text.startswith(text) and len(choice.text) > len(text)
        assert len(lps.tokens) == len(prompt_ids) + 1
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        lp = reference(hf, prompt_ids)
        for pos in range(1, len(prompt_ids)):
            want = lp[pos - 1, prompt_ids[pos]].item()
            assert abs(lps.token_logprobs[pos] - want) < TOLERANCE
            best = lp[pos - 1].max().item()  # the top-1 is among the top entries
            assert abs(max(lps.top_logprobs[pos].values()) - best) < TOLERANCE
        assert lps.text_offset[:2] == [0, len(lps.tokens[0])]
        assert lps.text_offset[len(prompt_ids)] == len(text)  # the completion after it
    assert resp.usage.prompt_tokens == sum(len(i) for i in ids)


def test_max_tokens_zero_returns_the_prompt_alone(client: openai.OpenAI, hf) -> None:
    resp = client.completions.create(model="meshcoder", prompt=PROMPTS[0], echo=True,
                                     logprobs=0, max_tokens=0)
    choice = resp.choices[0]
    ids = hf[0](PROMPTS[0])["input_ids"]
    assert choice.text == PROMPTS[0] and choice.finish_reason == "length"
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert resp.usage.completion_tokens == 0
    chunks = list(client.completions.create(model="meshcoder", prompt=PROMPTS[0], echo=True,
                                            max_tokens=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPTS[0]
    assert chunks[-1].usage.completion_tokens == 0  # the token made to end the prefill


def test_echo_without_logprobs_and_streamed(client: openai.OpenAI) -> None:
    kw = {"model": "meshcoder", "prompt": PROMPTS[1], "echo": True, "max_tokens": 6,
          "temperature": 0.0}
    whole = client.completions.create(**kw)
    assert whole.choices[0].text.startswith(PROMPTS[1]) and whole.choices[0].logprobs is None
    plain = client.completions.create(**{**kw, "echo": False})
    assert whole.choices[0].text == PROMPTS[1] + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == whole.choices[0].text
    chunks = list(client.completions.create(**kw, logprobs=1, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    with_lp = client.completions.create(**kw, logprobs=1)
    assert tokens == with_lp.choices[0].logprobs.tokens


def test_max_tokens_zero_without_echo_names_the_field(server) -> None:
    resp = httpx.post(f"{server.url}/v1/completions", timeout=30.0,
                      json={"prompt": "x", "max_tokens": 0})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "max_tokens" and "echo" in err["message"]
