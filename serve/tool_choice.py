"""What a chat request's `tools` and `tool_choice` ask of the model, and how its output
becomes `tool_calls`.

- `auto` (the default with tools): the template offers the tools, the model may call
  them in its own format, and the parser (Hermes `<tool_call>` blocks) finds the calls.
- `required`: the output is constrained (structured outputs) to a JSON array of one or
  more `{"name": ..., "parameters": {...}}` objects, each naming an offered tool with
  arguments that follow its schema (exactly one with `parallel_tool_calls: false`).
- a named function: the output is constrained to that function's arguments schema.
- `none`: no tools are offered and nothing is parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from meshserve.engine.core.sampling_params import StructuredOutputs
from meshserve.serve.tool_calls import ToolCall
from meshserve.serve.tool_calls import parse as parse_hermes


@dataclass(frozen=True)
class ToolPlan:
    """The tools a request offers and how its calls are found."""

    tools: list[dict[str, Any]]
    """As the template receives them."""
    mode: str
    """auto, required or named."""
    name: str | None = None
    """The function a named choice calls."""
    parallel: bool = True
    """Whether a required choice may make several calls (parallel_tool_calls)."""

    @property
    def forced(self) -> bool:
        """Whether the output is constrained to calls (required or named)."""
        return self.mode != "auto"

    def constraint(self) -> StructuredOutputs | None:
        """The structured output a forced choice needs (None for auto)."""
        if self.mode == "named":
            fn = next(t["function"] for t in self.tools if t["function"]["name"] == self.name)
            return StructuredOutputs(json=_arguments_schema(fn), source="tool_choice")
        if self.mode == "required":
            calls = [{"type": "object", "additionalProperties": False,
                      "required": ["name", "parameters"],
                      "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                     "parameters": _arguments_schema(t["function"])}}
                     for t in self.tools]
            array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                array["maxItems"] = 1
            return StructuredOutputs(json=array, source="tool_choice")
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; an output that is no call stays content."""
        if self.mode == "auto":
            return parse_hermes(text)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (max_tokens): the partial output is returned as is
        if self.mode == "named":
            assert self.name is not None
            return None, [ToolCall(self.name, json.dumps(value, ensure_ascii=False))]
        return None, [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                      for c in value if isinstance(c, dict) and isinstance(c.get("name"), str)]


def _arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}
