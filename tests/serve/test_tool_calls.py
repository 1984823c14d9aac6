"""Hermes tool calls parsed from generated text, whole and streamed in random pieces."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from meshserve.serve.tool_calls import ToolCallStream, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n' \
       '</tool_call>'


def test_one_call_and_no_content() -> None:
    content, calls = parse(CALL)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Zürich", "unit": "c"})]
    assert calls[0].as_dict()["type"] == "function"
    assert calls[0].id.startswith("call_")


def test_content_around_several_calls() -> None:
    other = CALL.replace("get_weather", "get_time")
    content, calls = parse(f"Let me check.\n{CALL}\n{other}\n")
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]


def test_a_broken_block_stays_content() -> None:
    text = "<tool_call>{not json}</tool_call> and <tool_call>{\"x\": 1}</tool_call>"
    assert parse(text) == (text, [])
    assert parse("no calls here") == ("no calls here", [])
    unclosed = '<tool_call>{"name": "f", "arguments": {}}'
    assert parse(unclosed) == (unclosed, [])


def stream(pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    s = ToolCallStream()
    content, calls = "", []
    for p in pieces:
        c, new = s.feed(p)
        content += c
        calls += [(k.name, k.arguments) for k in new]
    return content + s.finish(), calls


TEXTS = ["Let me check.\n" + CALL, CALL + CALL.replace("Zürich", "Bern"), "plain <tool text",
         "a <tool_call>{bad}</tool_call> b", 'x <tool_call>{"name": "f", "arguments": {}}',
         "ends with <tool_c"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_streamed_pieces_give_the_same_calls_and_text(text: str, cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    content, calls = stream(pieces)
    whole_content, whole_calls = parse(text)
    assert calls == [(c.name, c.arguments) for c in whole_calls]
    if not whole_calls:
        assert content == text  # nothing held back for good, nothing lost
    else:
        assert content.strip() == (whole_content or "")
