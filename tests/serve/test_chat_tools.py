"""Tools through the chat endpoint: offered to the template as transformers offers them,
calls parsed into `tool_calls` (whole and streamed), required and named choices
constrained to valid calls, and the requests it cannot honour."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from meshserve.engine.core.outputs import RequestOutput
from meshserve.models.bundled import BUNDLED_DIR
from meshserve.models.tokenizer import Tokenizer
from meshserve.serve.responses import LogprobFormatter, ResponseBuilder, ResponseMeta
from meshserve.serve.tool_choice import ToolPlan

from .conftest import ENGINE_OVERRIDES

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"], "additionalProperties": False}}}]
ASKED = [{"role": "user", "content": "Weather in Bern?"}]
ANSWERED = [*ASKED,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"}]
CALL_TEXT = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n' \
            '</tool_call>'


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model with Qwen2.5's published (Hermes-format) chat template."""
    d = tmp_path_factory.mktemp("qwen-template")
    for f in (BUNDLED_DIR / "meshcoder").iterdir():
        (d / f.name).symlink_to(f)
    (d / "chat_template.jinja").write_text((TEMPLATES / "qwen-2.5.jinja").read_text())
    return d


def hf_prompt_tokens(model_dir: Path, messages: list[dict], tools: list[dict] | None) -> int:
    """Tokens of transformers' rendering (arguments as objects, as templates expect)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    hf.chat_template = (model_dir / "chat_template.jinja").read_text()
    chat = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(
        c["function"]["arguments"])}} for c in m["tool_calls"]]) if m.get("tool_calls") else m
        for m in messages]
    text = hf.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=False)
    # (as apply_chat_template(tokenize=True) encodes it: no special tokens added)
    return len(Tokenizer(model_dir).encode(text, add_special_tokens=False))


def chat(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=60.0,
                      json={"max_tokens": 4, "temperature": 0, **body})


def test_tools_reach_the_template_and_unhonoured_choices_are_400(start_server,
                                                                 qwen_dir: Path) -> None:
    srv = start_server([*ENGINE_OVERRIDES, "engine.max_model_len=1024"], model=[str(qwen_dir)])
    for messages in (ASKED, ANSWERED):
        resp = chat(srv.url, messages=messages, tools=TOOLS)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["prompt_tokens"] == hf_prompt_tokens(qwen_dir, messages,
                                                                         TOOLS)
    plain = chat(srv.url, messages=ASKED, tools=TOOLS, tool_choice="none")
    assert plain.json()["usage"]["prompt_tokens"] == hf_prompt_tokens(qwen_dir, ASKED, None)
    unknown = chat(srv.url, messages=ASKED, tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "nope"}})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tool_choice"
    both = chat(srv.url, messages=ASKED, tools=TOOLS, tool_choice="required",
                response_format={"type": "json_object"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "tool_choice"
    no_tools = chat(srv.url, messages=ASKED, tool_choice="auto")
    assert no_tools.status_code == 400 and no_tools.json()["error"]["param"] == "tool_choice"
    twice = chat(srv.url, messages=ASKED, tools=TOOLS * 2)
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "tools"


def test_a_model_without_a_tool_format_refuses_auto_tools(server) -> None:
    resp = chat(server.url, messages=ASKED, tools=TOOLS)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "tools" and "serve.tool_call_parser" in err["message"]


def check_call(call: dict, names: set[str]) -> None:
    import jsonschema

    assert call["type"] == "function" and call["id"].startswith("call_")
    fn = call["function"]
    assert fn["name"] in names
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn["name"])
    jsonschema.validate(json.loads(fn["arguments"]), schema)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_required_and_named_choices_constrain_the_output_to_calls(server, stream: bool) -> None:
    """Any model, whatever its template: the output is constrained to valid calls."""
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, names in (("required", {"get_weather", "get_time"}), (named, {"get_time"})):
        kw = dict(model="meshcoder", messages=ASKED, tools=TOOLS, tool_choice=choice,
                  max_tokens=120, temperature=0, parallel_tool_calls=False)
        if not stream:
            msg = client.chat.completions.create(**kw).choices[0]
            calls = [c.model_dump() for c in msg.message.tool_calls]
            assert msg.finish_reason == "tool_calls" and msg.message.content is None
        else:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            calls = [c.model_dump() for ch in chunks for d in ch.choices
                     for c in (d.delta.tool_calls or [])]
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            assert [c.pop("index") for c in calls] == list(range(len(calls)))
        assert calls
        for call in calls:
            check_call(call, names)


def output(text: str, new: str, finished: bool) -> RequestOutput:
    return RequestOutput("r", [1], token_ids=[2], text=text, new_token_ids=[2], new_text=new,
                         finished=finished, finish_reason="stop" if finished else None)


def test_calls_in_the_output_become_tool_calls_whole_and_streamed() -> None:
    meta = ResponseMeta("chatcmpl-1", 0, "m", True, False, tools=ToolPlan(TOOLS, "auto"))
    body = ResponseBuilder(meta, LogprobFormatter(None)).body(
        [output(CALL_TEXT, CALL_TEXT, True)], [1])
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Bern"}'}

    builder = ResponseBuilder(meta, LogprobFormatter(None))
    pieces = [CALL_TEXT[i:i + 7] for i in range(0, len(CALL_TEXT), 7)]
    deltas, text = [], ""
    for k, p in enumerate(pieces):
        text += p
        deltas.append(builder.chunk(0, output(text, p, k == len(pieces) - 1))["choices"][0])
    content = "".join(d["delta"].get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert content == "Checking.\n"
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
    assert deltas[-1]["finish_reason"] == "tool_calls"
