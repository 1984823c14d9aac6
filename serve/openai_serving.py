"""Turns an OpenAI request into engine requests and their outputs into a response.

Non-streaming requests are raced against the client's disconnect; streams watch for it
while they wait. Either way a client that leaves has its unfinished choices aborted, so
their KV blocks return to the pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from meshserve.engine.core.outputs import RequestOutput
from meshserve.models.tokenizer import Tokenizer
from meshserve.serve.async_engine import (
    AsyncEngine,
    Choice,
    EngineDeadError,
    EngineFailure,
    OverloadedError,
    StreamItem,
)
from meshserve.serve.errors import APIError, error_body, from_value_error, unknown_model
from meshserve.serve.metrics import ServerMetrics
from meshserve.serve.protocol import (
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingBody,
    TextPart,
)
from meshserve.serve.responses import Echo, LogprobFormatter, ResponseBuilder, ResponseMeta, sse
from meshserve.serve.serve_config import ServeConfig
from meshserve.serve.tool_calls import OPEN
from meshserve.serve.tool_choice import ToolPlan

DEFAULT_COMPLETION_TOKENS = 16
"""OpenAI's default max_tokens for /v1/completions (chat defaults to the context left)."""


class _SSEResponse(StreamingResponse):
    """A stream that also ends when the client disconnects, and always closes its iterator
    (the iterator's `finally` aborts unfinished choices)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _disconnected(request: Request) -> None:
    """Return once the client has gone."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class TokenLimit:
    """A request's limit on generated tokens: the value it asked for under which field
    (None: not asked), and the default when it asked for none (None: the context left)."""

    asked: int | None
    field: str
    default: int | None


class OpenAIServing:
    """The completions and chat endpoints over one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, model_names: list[str], cfg: ServeConfig,
                 metrics: ServerMetrics) -> None:
        self.engine = engine
        self.model_names = model_names
        self.cfg = cfg
        self.metrics = metrics
        self.tokenizer: Tokenizer | None = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.vocab_size = engine.engine.arch.vocab_size
        self.formatter = LogprobFormatter(self.tokenizer)
        self.tool_parser = _tool_parser(cfg.tool_call_parser, self.tokenizer)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        """POST /v1/completions."""
        prompts = self._prompts(body.prompt)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 without echo; allowed is an int >= 1, or 0 "
                                "with echo=true (the prompt alone, scored)", "max_tokens")
        # max_tokens=0: one token is generated and dropped (the prompt's log-probs come
        # from the same prefill).
        limit = TokenLimit(1 if body.max_tokens == 0 else body.max_tokens, "max_tokens",
                           DEFAULT_COMPLETION_TOKENS)
        echo = None
        if body.echo:
            given = (body.prompt if isinstance(body.prompt, list)
                     and isinstance(body.prompt[0], (str, list)) else [body.prompt])
            echo = Echo([p if isinstance(p, str) else self._decode(ids)
                         for p, ids in zip(given, prompts)], body.n, body.max_tokens == 0)
        return await self._serve(body, request, prompts, "prompt", body.logprobs, limit, False,
                                 echo=echo)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        """POST /v1/chat/completions."""
        if self.tokenizer is None:
            raise APIError(400, "messages: this model has no tokenizer; allowed is "
                                "/v1/completions with token ids", "messages")
        for i, m in enumerate(body.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if not isinstance(part, TextPart):
                    raise APIError(400, f"messages.{i}.content.{j}: a {part.type} part; this "
                                        "model takes text only: allowed are text parts",
                                   "messages")
        plan = self._tool_plan(body)
        messages = [m.for_template() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, body.add_generation_prompt, tools=plan.tools if plan else None,
                documents=body.documents, **(body.chat_template_kwargs or {}))
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: allowed only with logprobs=true", "top_logprobs")
        limit = (TokenLimit(body.max_completion_tokens, "max_completion_tokens", None)
                 if body.max_completion_tokens is not None
                 else TokenLimit(body.max_tokens, "max_tokens", None))
        # The template writes the special tokens it wants (a BOS among them): encoding adds
        # none, as transformers' apply_chat_template(tokenize=True) and vLLM do.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return await self._serve(body, request, [ids], "messages", logprobs, limit, True, plan)

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        """The tools offered and how calls are found (None: no tools, or tool_choice=none);
        a 400 for a choice that cannot be honoured."""
        choice = body.tool_choice
        if not body.tools:
            if choice is not None and choice != "none":
                raise APIError(400, f"tool_choice: {_choice_text(choice)} without tools; "
                                    "allowed is 'none' or giving tools", "tool_choice")
            return None
        if choice == "none":
            return None
        names = [t.function.name for t in body.tools]
        if len(set(names)) < len(names):
            raise APIError(400, f"tools: function names repeat ({names}); allowed are "
                                "distinct names", "tools")
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in body.tools]
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice: the function {choice.function.name!r} is "
                                    f"not among the tools; allowed: {names}", "tool_choice")
            return ToolPlan(tools, "named", choice.function.name)
        if choice == "required":
            return ToolPlan(tools, "required", parallel=body.parallel_tool_calls is not False)
        if self.tool_parser is None:
            raise APIError(400, "tools: this model's chat template asks for no tool-call "
                                "format meshserve parses; allowed is serve.tool_call_parser="
                                "hermes where the model writes <tool_call> blocks, or "
                                "tool_choice 'required' or a named function", "tools")
        return ToolPlan(tools, "auto")

    def _prompts(self, prompt: Any) -> list[list[int]]:
        """Token ids of each prompt of a completions request."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if len(prompt) > self.cfg.max_batch_prompts:
            raise APIError(400, f"prompt: {len(prompt)} prompts; allowed is at most "
                                f"serve.max_batch_prompts={self.cfg.max_batch_prompts}", "prompt")
        if any(isinstance(p, str) for p in prompt) and self.tokenizer is None:
            raise APIError(400, "prompt: this model has no tokenizer; allowed are token ids",
                           "prompt")
        tok = self.tokenizer
        return [tok.encode(p) if isinstance(p, str) and tok is not None else list(p)
                for p in prompt]

    def _choices(self, body: SamplingBody, prompts: list[list[int]], field: str,
                 logprobs: int | None, limit: TokenLimit, request_id: str,
                 plan: ToolPlan | None = None) -> list[Choice]:
        """One engine request per prompt and n. A token limit asked for beyond the context
        left is a 400 with the numbers, as OpenAI answers; the default one (the context
        left, or completions' 16) is clipped to it."""
        if body.model is not None and body.model not in self.model_names:
            raise unknown_model(body.model, self.model_names)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: given without stream; allowed only with "
                                "stream=true", "stream_options")
        count = _candidates(body)
        if count > self.cfg.max_n:
            field = "best_of" if count > body.n else "n"
            raise APIError(400, f"{field}: {count}; allowed is at most serve.max_n="
                                f"{self.cfg.max_n}", field)
        if count > body.n and logprobs is None:
            logprobs = 0  # candidates are ranked by their sampled tokens' logprobs
        forced = plan.constraint() if plan is not None else None  # tool_choice's grammar
        choices = []
        for p, ids in enumerate(prompts):
            if len(ids) >= self.max_model_len:
                raise APIError(400, f"{field}: {len(ids)} tokens; allowed is fewer than the "
                                    f"context length max_model_len={self.max_model_len}", field)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise APIError(400, f"{field}: token ids {bad[:5]} outside the vocabulary; "
                                    f"allowed are ints in [0, {self.vocab_size})", field)
            room = self.max_model_len - len(ids)
            if limit.asked is not None and limit.asked > room:
                raise APIError(400, f"{limit.field}: {limit.asked} with a {len(ids)}-token "
                                    f"prompt exceeds the context length max_model_len="
                                    f"{self.max_model_len}; allowed is at most {room}",
                               limit.field)
            max_tokens = limit.asked or min(limit.default or room, room)
            for j in range(count):
                params = body.sampling_params(max_tokens, logprobs)
                if forced is not None:
                    if params.structured_outputs is not None:
                        raise APIError(400, f"tool_choice: {_choice_text(body.tool_choice)} "
                                            f"constrains the output, and so does "
                                            f"{params.structured_outputs.source}; allowed is "
                                            "one", "tool_choice")
                    params = dataclasses.replace(params, structured_outputs=forced)
                if body.seed is not None and j:  # distinct but reproducible choices
                    params = dataclasses.replace(params, seed=(body.seed + j) % (MAX_SEED + 1))
                choices.append(Choice(f"{request_id}-{p * count + j}", ids, params))
        return choices

    async def _serve(self, body: SamplingBody, request: Request, prompts: list[list[int]],
                     field: str, logprobs: int | None, limit: TokenLimit,
                     chat: bool, plan: ToolPlan | None = None,
                     echo: Echo | None = None) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            choices = self._choices(body, prompts, field, logprobs, limit, request_id, plan)
            stream = await self.engine.add(choices)
        except ValueError as e:
            raise from_value_error(e) from None
        except (OverloadedError, EngineDeadError) as e:
            raise APIError(503, str(e)) from None
        meta = ResponseMeta(request_id, int(time.time()), body.model or self.model_names[0], chat,
                            body.return_token_ids, plan, echo)
        builder = ResponseBuilder(meta, self.formatter)
        ids = [c.request_id for c in choices]
        prompt_lens = [len(p) for p in prompts]
        if body.stream:
            return _SSEResponse(self._events(stream, ids, builder, prompt_lens,
                                             body.include_usage),
                                media_type="text/event-stream")
        return await self._respond(body, request, stream, ids, builder, prompt_lens)

    async def _respond(self, body: SamplingBody, request: Request,
                       stream: asyncio.Queue[StreamItem], ids: list[str],
                       builder: ResponseBuilder, prompt_lens: list[int]) -> Response:
        finals: dict[int, RequestOutput] = {}
        collect = asyncio.ensure_future(_collect(stream, len(ids), finals))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()
                self._abort(ids, finals)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)  # nobody is listening any more
        failure = collect.result()
        if failure is not None:
            self.metrics.errors.labels("503").inc()
            return JSONResponse(error_body(503, failure.message), status_code=503)
        outs = [finals[i] for i in range(len(ids))]
        if isinstance(body, CompletionRequest) and _candidates(body) > body.n:
            return JSONResponse(builder.body(_best(outs, body), prompt_lens, usage_of=outs))
        return JSONResponse(builder.body(outs, prompt_lens))

    async def _events(self, stream: asyncio.Queue[StreamItem], ids: list[str],
                      builder: ResponseBuilder, prompt_lens: list[int],
                      include_usage: bool) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        try:
            if builder.meta.chat:
                for i in range(len(ids)):
                    yield sse(builder.role_chunk(i))
            while len(finals) < len(ids):
                item = await stream.get()
                if isinstance(item, EngineFailure):
                    self.metrics.errors.labels("503").inc()
                    yield sse(error_body(503, item.message))
                    return
                index, out = item
                if out.finished:
                    finals[index] = out
                yield sse(builder.chunk(index, out))
            if include_usage:
                yield sse(builder.usage_chunk([finals[i] for i in range(len(ids))], prompt_lens))
            yield sse("[DONE]")
        finally:
            self._abort(ids, finals)

    def _abort(self, ids: list[str], finals: dict[int, RequestOutput]) -> None:
        left = [rid for i, rid in enumerate(ids) if i not in finals]
        if left and self.engine.failure is None:
            self.engine.abort(left)
            self.metrics.aborted.inc(len(left))


def _tool_parser(name: str, tokenizer: Tokenizer | None) -> str | None:
    """serve.tool_call_parser resolved against the model's chat template."""
    if name == "auto":
        template = tokenizer.chat_template if tokenizer is not None else None
        return "hermes" if template is not None and OPEN in str(template) else None
    return None if name == "none" else name


def _choice_text(choice: object) -> str:
    if isinstance(choice, NamedToolChoice):
        return f"the function {choice.function.name!r}"
    return repr(choice)


def _candidates(body: SamplingBody) -> int:
    """Engine requests per prompt: best_of (at least n; not streamed) or n."""
    if not isinstance(body, CompletionRequest) or body.best_of is None:
        return body.n
    if body.best_of < body.n:
        raise APIError(400, f"best_of: {body.best_of}; allowed is at least n={body.n}",
                       "best_of")
    if body.stream and body.best_of > body.n:
        raise APIError(400, f"best_of: {body.best_of} with stream=true; allowed is best_of "
                            f"equal to n={body.n} when streaming", "best_of")
    return body.best_of


def _best(outs: list[RequestOutput], body: CompletionRequest) -> list[RequestOutput]:
    """Each prompt's n candidates with the highest cumulative logprob, best first (logprobs
    dropped where the request did not ask for them)."""
    count = _candidates(body)
    kept = []
    for start in range(0, len(outs), count):
        group = outs[start:start + count]
        group.sort(key=lambda o: -sum(lp for lp, _ in o.logprobs or []))
        kept += [o if body.logprobs is not None else dataclasses.replace(o, logprobs=None)
                 for o in group[:body.n]]
    return kept


async def _collect(stream: asyncio.Queue[StreamItem], n: int,
                   finals: dict[int, RequestOutput]) -> EngineFailure | None:
    """Wait for every choice's final output (into `finals`), or the engine's failure."""
    while len(finals) < n:
        item = await stream.get()
        if isinstance(item, EngineFailure):
            return item
        index, out = item
        if out.finished:
            finals[index] = out
    return None

