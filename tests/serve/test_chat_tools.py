"""Tools through the chat endpoint: offered to the template as transformers offers them,
calls parsed into `tool_calls` (whole and streamed), and the choices it cannot honour."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from meshserve.engine.outputs import RequestOutput
from meshserve.models.bundled import BUNDLED_DIR
from meshserve.models.tokenizer import Tokenizer
from meshserve.serve.responses import LogprobFormatter, ResponseBuilder, ResponseMeta

from .conftest import ENGINE_OVERRIDES

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
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
    return len(Tokenizer(model_dir).encode(text))


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
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        bad = chat(srv.url, messages=ASKED, tools=TOOLS, tool_choice=choice)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice", bad.text
    no_tools = chat(srv.url, messages=ASKED, tool_choice="auto")
    assert no_tools.status_code == 400 and no_tools.json()["error"]["param"] == "tool_choice"
    twice = chat(srv.url, messages=ASKED, tools=TOOLS * 2)
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "tools"


def test_a_model_without_a_tool_format_refuses_tools(server) -> None:
    resp = chat(server.url, messages=ASKED, tools=TOOLS)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "tools" and "serve.tool_call_parser" in err["message"]


def output(text: str, new: str, finished: bool) -> RequestOutput:
    return RequestOutput("r", [1], token_ids=[2], text=text, new_token_ids=[2], new_text=new,
                         finished=finished, finish_reason="stop" if finished else None)


def test_calls_in_the_output_become_tool_calls_whole_and_streamed() -> None:
    meta = ResponseMeta("chatcmpl-1", 0, "m", True, False, parse_tools=True)
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
