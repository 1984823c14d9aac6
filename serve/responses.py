"""OpenAI response bodies and stream chunks built from the engine's RequestOutputs."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from meshserve.engine.core.outputs import RequestOutput
from meshserve.models.tokenizer import Tokenizer
from meshserve.serve.tool_calls import ToolCallStream
from meshserve.serve.tool_choice import ToolPlan

Logprobs = list[tuple[float, list[tuple[int, float]]]]


@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one HTTP request repeats."""

    id: str
    created: int
    model: str
    chat: bool
    return_token_ids: bool
    tools: ToolPlan | None = None
    """A chat request's tools: calls in the output become the message's tool_calls."""
    echo: Echo | None = None
    """A completions request with echo=true."""


@dataclass(frozen=True)
class Echo:
    """A completions request's echo: the prompts come back before their completions."""

    texts: list[str]
    """Each prompt's text (a token-id prompt decoded)."""
    n: int
    """Choices per prompt: choice i echoes prompt i // n."""
    score_only: bool
    """max_tokens=0: the prompt alone, nothing generated (the one token the engine made
    to finish the prefill is dropped)."""


def generated_nothing(out: RequestOutput) -> RequestOutput:
    """`out` without its generated tokens (echo with max_tokens=0)."""
    return replace(out, token_ids=[], text="", new_token_ids=[], new_text="",
                   logprobs=[] if out.logprobs is not None else None,
                   finish_reason="length" if out.finished else None)


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def usage(prompt_lens: list[int], outs: list[RequestOutput]) -> dict[str, int]:
    """Token counts: each prompt once, every choice's generated tokens."""
    prompt = sum(prompt_lens)
    completion = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class LogprobFormatter:
    """The engine's (logprob, top-n) pairs in the completions or chat layout."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        """A token's text (special tokens kept; an id without a tokenizer)."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(self, token_ids: list[int], lps: Logprobs, offset: int) -> dict[str, Any]:
        """{tokens, token_logprobs, top_logprobs, text_offset} starting at text `offset`."""
        tokens = [self.token(t) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in lps],
                "top_logprobs": [{self.token(t): v for t, v in top} for _, top in lps],
                "text_offset": _offsets(tokens, offset)}

    def prompt(self, token_ids: list[int], lps: list[dict[int, float] | None] | None
               ) -> dict[str, Any]:
        """An echoed prompt's {tokens, token_logprobs, top_logprobs, text_offset}: null
        for the first token (nothing predicts it), then the token's log-prob and the top
        ones at its position, the token among them (vLLM's layout)."""
        tokens = [self.token(t) for t in token_ids]
        entries = lps if lps is not None else [None] * len(token_ids)
        return {"tokens": tokens,
                "token_logprobs": [e[t] if e is not None else None
                                   for t, e in zip(token_ids, entries)],
                "top_logprobs": [{self.token(a): v for a, v in e.items()} if e is not None
                                 else None for e in entries],
                "text_offset": _offsets(tokens, 0)}

    def chat(self, token_ids: list[int], lps: Logprobs) -> dict[str, Any]:
        """{content: [{token, logprob, bytes, top_logprobs}]}."""
        def entry(t: int, lp: float) -> dict[str, Any]:
            text = self.token(t)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                            for t, (lp, top) in zip(token_ids, lps)]}


class ResponseBuilder:
    """Whole bodies (non-streaming) and chunks (streaming) of one HTTP request."""

    def __init__(self, meta: ResponseMeta, formatter: LogprobFormatter) -> None:
        self.meta = meta
        self.fmt = formatter
        self._text_offsets: dict[int, int] = {}
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._echoed: set[int] = set()

    def _head(self, streaming: bool) -> dict[str, Any]:
        m = self.meta
        kind = ("chat.completion.chunk" if streaming else "chat.completion") if m.chat \
            else "text_completion"
        return {"id": m.id, "object": kind, "created": m.created, "model": m.model}

    def _shown(self, out: RequestOutput) -> RequestOutput:
        """What a choice shows of `out`: nothing generated where echo scores the prompt
        alone (max_tokens=0), else all of it."""
        echo = self.meta.echo
        return generated_nothing(out) if echo is not None and echo.score_only else out

    def _echo(self, index: int, out: RequestOutput) -> tuple[str, dict[str, Any] | None]:
        """Choice `index`'s echoed prompt: its text, and with logprobs its tokens' (after
        which the completion's text offsets continue); ("", None) without echo."""
        echo = self.meta.echo
        if echo is None:
            return "", None
        text = echo.texts[index // echo.n]
        if out.logprobs is None:
            return text, None
        self._text_offsets[index] = len(text)
        return text, self.fmt.prompt(out.prompt_token_ids, out.prompt_logprobs)

    def _logprobs(self, token_ids: list[int], lps: Logprobs | None, index: int
                  ) -> dict[str, Any] | None:
        if lps is None:
            return None
        if self.meta.chat:
            return self.fmt.chat(token_ids, lps)
        offset = self._text_offsets.get(index, 0)
        out = self.fmt.completion(token_ids, lps, offset)
        self._text_offsets[index] = offset + sum(len(t) for t in out["tokens"])
        return out

    def body(self, outs: list[RequestOutput], prompt_lens: list[int],
             usage_of: list[RequestOutput] | None = None) -> dict[str, Any]:
        """The non-streaming response: one choice per output, in order; usage counts
        `usage_of` (every candidate generated, where best_of kept only some) or `outs`."""
        choices = []
        outs = [self._shown(o) for o in outs]
        usage_of = [self._shown(o) for o in usage_of] if usage_of else None
        for i, o in enumerate(outs):
            head, lps = self._echo(i, o)
            lps = _joined(lps, self._logprobs(o.token_ids, o.logprobs, i))
            c: dict[str, Any] = {"index": i, "logprobs": lps, "finish_reason": o.finish_reason}
            if self.meta.chat:
                c["message"] = {"role": "assistant", "content": o.text}
                if self.meta.tools is not None:
                    content, calls = self.meta.tools.parse(o.text)
                    c["message"] = {"role": "assistant", "content": content,
                                    "tool_calls": [call.as_dict() for call in calls]}
                    if calls and o.finish_reason == "stop":
                        c["finish_reason"] = "tool_calls"
            else:
                c["text"] = head + o.text
            if self.meta.return_token_ids:
                c["token_ids"] = list(o.token_ids)
            choices.append(c)
        return {**self._head(False), "choices": choices,
                "usage": usage(prompt_lens, usage_of if usage_of is not None else outs)}

    def role_chunk(self, index: int) -> dict[str, Any]:
        """A chat stream's first chunk of a choice: the assistant role."""
        return {**self._head(True), "choices": [{"index": index, "delta": {
            "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}

    def chunk(self, index: int, out: RequestOutput) -> dict[str, Any]:
        """The delta one engine step added to choice `index` (its first, with echo, after
        the prompt)."""
        out = self._shown(out)
        head, echoed = self._echo(index, out) if index not in self._echoed else ("", None)
        self._echoed.add(index)
        new_ids = out.new_token_ids
        lps = out.logprobs[-len(new_ids):] if out.logprobs is not None and new_ids else (
            [] if out.logprobs is not None else None)
        c: dict[str, Any] = {"index": index,
                             "logprobs": _joined(echoed, self._logprobs(new_ids, lps, index)),
                             "finish_reason": out.finish_reason if out.finished else None}
        if self.meta.chat and self.meta.tools is not None:
            c["delta"], num_calls = self._tool_delta(index, out, self.meta.tools)
            if out.finished and out.finish_reason == "stop" and num_calls:
                c["finish_reason"] = "tool_calls"
        elif self.meta.chat:
            c["delta"] = {"content": out.new_text} if out.new_text else {}
        else:
            c["text"] = head + out.new_text
        if self.meta.return_token_ids:
            c["token_ids"] = list(new_ids)
        return {**self._head(True), "choices": [c]}

    def _tool_delta(self, index: int, out: RequestOutput,
                    plan: ToolPlan) -> tuple[dict[str, Any], int]:
        """A chat delta with the content around tool calls and each call once complete (a
        forced choice's calls, all at the end), and the calls sent so far."""
        if plan.forced:
            if not out.finished:
                return {}, 0
            content, calls = plan.parse(out.text)
            before = 0
        else:
            stream = self._tool_streams.setdefault(index, ToolCallStream())
            before = stream.num_calls
            content, calls = stream.feed(out.new_text)
            if out.finished:
                content += stream.finish()
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": before + k, **call.as_dict()}
                                   for k, call in enumerate(calls)]
        return delta, before + len(calls)

    def usage_chunk(self, outs: list[RequestOutput], prompt_lens: list[int]) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage (no choices)."""
        return {**self._head(True), "choices": [],
                "usage": usage(prompt_lens, [self._shown(o) for o in outs])}


def _offsets(tokens: list[str], start: int) -> list[int]:
    """Each token's offset in the text they make, from `start`."""
    out = []
    for t in tokens:
        out.append(start)
        start += len(t)
    return out


def _joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions logprobs objects as one (an echoed prompt's, then the output's)."""
    if first is None or then is None:
        return then if first is None else first
    return {k: first[k] + then[k] for k in first}
