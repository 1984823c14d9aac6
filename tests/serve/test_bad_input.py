"""Bad input gets a 4xx naming the field, never a 5xx, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

GOOD = {"model": "meshcoder", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
CHAT = {"model": "meshcoder", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def post(server, path: str, **kw: object) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60.0, **kw)  # type: ignore[arg-type]


def assert_error(resp: httpx.Response, status: int, param: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param), err
    assert err["code"] is None or isinstance(err["code"], str), err  # (OpenAI's: a string or null)


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", 3.0), ("top_p", 0.0), ("top_p", 1.5),
    ("max_tokens", 0), ("n", 0), ("n", 1000), ("logprobs", 50), ("seed", -1),
    ("top_k", 0), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]), ("min_tokens", 9),
    ("temperature", "hot"), ("max_tokens", "5"), ("max_tokens", 2.5), ("stream", "yes"),
    ("n", True), ("prompt", 5), ("prompt", [[]]), ("prompt", [-1]), ("prompt", [99999]),
    ("prompt", []), ("stop", 7), ("echo", "yes"), ("suffix", "x"),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("min_p", 1.5), ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 150}),
    ("logit_bias", {"99999": 1}), ("logit_bias", [1]), ("best_of", 0),
])
def test_bad_completion_fields_name_the_field(server, field: str, value: object) -> None:
    assert_error(post(server, "/v1/completions", json={**GOOD, field: value}), 400, field)


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "logit_bias": {"-3": 1}}, "logit_bias"),
    ({**CHAT, "service_tier": "flex"}, "service_tier"),
])
def test_bad_chat_fields_name_the_field(server, body: dict, param: str) -> None:
    assert_error(post(server, "/v1/chat/completions", json=body), 400, param)


@pytest.mark.parametrize("path, field, value", [
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ("/v1/chat/completions", "store", True),
    ("/v1/chat/completions", "reasoning_effort", "high"),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/completions", "suffix", "return x"),
])
def test_unimplemented_fields_are_named_as_unsupported(server, path: str, field: str,
                                                       value: object) -> None:
    base = CHAT if "chat" in path else GOOD
    resp = post(server, path, json={**base, field: value})
    assert_error(resp, 400, field)
    assert "unsupported by meshserve" in resp.json()["error"]["message"]


def test_hints_and_defaults_of_unimplemented_fields_are_accepted(server) -> None:
    hints = {"user": "u1", "metadata": {"k": "v"}, "service_tier": "auto",
             "prompt_cache_key": "tenant-1", "safety_identifier": "s", "store": False,
             "modalities": ["text"], "tool_choice": "none", "response_format": {"type": "text"},
             "tools": None, "parallel_tool_calls": True, "chat_template_kwargs": {"x": 1}}
    resp = post(server, "/v1/chat/completions", json={**CHAT, **hints})
    assert resp.status_code == 200, resp.text


def test_best_of_below_n_or_streamed_is_a_400(server) -> None:
    assert_error(post(server, "/v1/completions", json={**GOOD, "n": 3, "best_of": 2}), 400,
                 "best_of")
    streamed = post(server, "/v1/completions",
                    json={**GOOD, "n": 1, "best_of": 2, "stream": True})
    assert_error(streamed, 400, "best_of")
    assert_error(post(server, "/v1/completions", json={**GOOD, "best_of": 1000}), 400,
                 "best_of")


def test_too_long_prompt_unknown_model_and_missing_field(server) -> None:
    long = post(server, "/v1/completions", json={**GOOD, "prompt": "x = 1\n" * 400})
    assert_error(long, 400, "prompt")
    assert "max_model_len=256" in long.json()["error"]["message"]
    chat = post(server, "/v1/chat/completions",
                json={**CHAT, "messages": [{"role": "user", "content": "y = 2\n" * 400}]})
    assert_error(chat, 400, "messages")
    assert_error(post(server, "/v1/completions", json={**GOOD, "model": "gpt-9"}), 404, "model")
    no_prompt = {k: v for k, v in GOOD.items() if k != "prompt"}
    assert_error(post(server, "/v1/completions", json=no_prompt), 400, "prompt")


@pytest.mark.parametrize("content", [b"{\"prompt\": ", b"not json", b"[1, 2]", b"",
                                     b"\xff\xfe{\"prompt\": \"x\"}",
                                     "{\"prompt\": \"caf\u00e9\"}".encode("latin-1")])
def test_malformed_and_non_utf8_bodies(server, content: bytes) -> None:
    resp = post(server, "/v1/completions", content=content,
                headers={"content-type": "application/json"})
    assert_error(resp, 400, "body")


@pytest.mark.slow
def test_schema_fuzz_finds_no_server_error(server) -> None:
    """Positive and negative cases of every operation in our OpenAPI schema: all < 500."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                       "/health", "/metrics"}
    seen: dict[int, int] = {}
    for op in ops:
        modes = [GenerationMode.POSITIVE]
        if len(op.body):  # an operation without a body or parameters has no invalid form
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            @settings(max_examples=15, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case) -> None:  # noqa: ANN001 - a schemathesis Case
                resp = case.call(base_url=server.url, timeout=60)
                seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
                assert resp.status_code < 500, (case.body, resp.text)

            check()
    assert 200 in seen and any(400 <= s < 500 for s in seen), seen
    assert httpx.get(f"{server.url}/health").status_code == 200
    m = server.wait_idle()
    assert m["meshserve_kv_blocks_free"] == m["meshserve_kv_blocks_total"]


def test_server_still_serves_after_bad_input(server) -> None:
    resp = post(server, "/v1/completions", json=GOOD)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_max_tokens_beyond_the_context_is_a_400_with_the_numbers(server) -> None:
    ids = [5] * 200  # max_model_len=256: 56 tokens left
    resp = post(server, "/v1/completions", json={**GOOD, "prompt": ids, "max_tokens": 57})
    assert_error(resp, 400, "max_tokens")
    assert resp.json()["error"]["message"] == (
        "max_tokens: 57 with a 200-token prompt exceeds the context length "
        "max_model_len=256; allowed is at most 56")
    fits = post(server, "/v1/completions", json={**GOOD, "prompt": ids, "max_tokens": 56})
    assert fits.status_code == 200, fits.text
    default = post(server, "/v1/completions",  # the default 16 is clipped to the 6 left
                   json={k: v for k, v in {**GOOD, "prompt": [5] * 250}.items()
                         if k != "max_tokens"})
    assert default.status_code == 200, default.text
    chat = post(server, "/v1/chat/completions", json={**CHAT, "max_completion_tokens": 10**6})
    assert_error(chat, 400, "max_completion_tokens")


def test_a_union_field_names_the_real_problem(server) -> None:
    resp = post(server, "/v1/completions", json={**GOOD, "prompt": [1, -1]})
    assert resp.json()["error"]["message"] == (
        "prompt.1: Input should be greater than or equal to 0 (got -1)")
