"""Tool calls in generated text, parsed into OpenAI's `tool_calls`.

The Hermes format (Hermes 2 Pro, Qwen2.5 and others whose chat template asks for it): each
call is a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
`</tool_call>`; text outside the tags is the message's content. A block whose JSON does
not parse, or lacks a name, stays in the content as it was generated.

Streaming holds back text from a `<tool_call>` tag (or a tail that may still become one)
until its block closes, then sends the whole call in one delta; the content around it
streams as it comes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

PARSERS = ("hermes",)
"""Formats meshserve parses (serve.tool_call_parser)."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call."""

    name: str
    arguments: str
    """The arguments as a JSON string (OpenAI's wire format)."""
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(body: str) -> ToolCall | None:
    """The call in one block's body, or None if it is no call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str)
                    else json.dumps(args, ensure_ascii=False))


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole generation; content None when only calls remain."""
    calls: list[ToolCall] = []
    pieces: list[str] = []
    end = 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1).strip())
        if call is None:
            continue
        pieces.append(text[end:m.start()])
        calls.append(call)
        end = m.end()
    pieces.append(text[end:])
    content = "".join(pieces)
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls


class ToolCallStream:
    """Incremental parse of one choice's streamed text."""

    def __init__(self) -> None:
        self._held = ""
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed by this delta)."""
        text = self._held + delta
        out, calls = [], []
        while True:
            start = text.find(OPEN)
            if start < 0:
                keep = _partial_tail(text, OPEN)
                out.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            stop = text.find(CLOSE, start)
            if stop < 0:  # an open block: hold it until it closes
                out.append(text[:start])
                self._held = text[start:]
                break
            call = _call(text[start + len(OPEN):stop].strip())
            block_end = stop + len(CLOSE)
            if call is None:
                out.append(text[:block_end])
            else:
                out.append(text[:start])
                calls.append(call)
            text = text[block_end:]
        self.num_calls += len(calls)
        return "".join(out), calls

    def finish(self) -> str:
        """What is still held (an unclosed block stays content), at the end."""
        held, self._held = self._held, ""
        return held


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
