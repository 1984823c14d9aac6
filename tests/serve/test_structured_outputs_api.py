"""Structured outputs through the API: response_format (json_object, json_schema) with the
official client, vLLM's extensions, streaming, and 400s naming what cannot compile."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

MODEL = "meshcoder"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "yy"]}, "maxItems": 2},
    "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "tags", "n"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a thing as JSON."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_response_format_json_schema_and_object(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA,
                                                  "strict": True}}
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80,
                                         temperature=0.7, seed=1, n=3, response_format=fmt)
    for c in got.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    obj = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200,
                                         temperature=0, response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_streamed_constrained_text_is_the_whole_text(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, response_format=fmt)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or ""
                       for ch in client.chat.completions.create(**kw, stream=True)
                       if ch.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_vllm_extensions_on_both_endpoints(client: openai.OpenAI) -> None:
    regex = client.completions.create(model=MODEL, prompt="id = ", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"[A-Z]{2}[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}[0-9]{3}", regex.choices[0].text)
    choice = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=4,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert choice.choices[0].message.content in ("red", "green", "blue")
    grammar = client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=20, temperature=0,
        extra_body={"guided_grammar": 'root ::= [0-9] [0-9]? " + " [0-9] [0-9]?'})
    assert re.fullmatch(r"[0-9]{1,2} \+ [0-9]{1,2}", grammar.choices[0].text)
    schema = client.completions.create(model=MODEL, prompt="data = ", max_tokens=80,
                                       temperature=0, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(schema.choices[0].text), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "strin"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_what_cannot_compile_or_combine_is_a_400(server, body: dict, param: str) -> None:
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 8, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err
