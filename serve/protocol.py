"""OpenAI request bodies (/v1/completions, /v1/chat/completions) as strict pydantic models.

Strict: a string is no number and a bool is no int, as in OpenAI's API. Every field of
OpenAI's two request schemas is declared: it works, it is a hint that changes nothing
(`user`, `metadata`, `prompt_cache_key`, `safety_identifier`, `service_tier`), or a value
other than its default is a 400 naming it as unsupported. Fields OpenAI does not have are
ignored (as vLLM does), except meshserve's extensions: `ignore_eos`, `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `return_token_ids`, `add_generation_prompt`,
`documents`, `chat_template_kwargs`, `structured_outputs` and vLLM's `guided_*`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from meshserve.engine.core.sampling_params import MAX_LOGIT_BIAS, SamplingParams, StructuredOutputs

MAX_SEED = 2**63 - 1
MAX_STOP = 4

TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
Stop = str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)]


def unsupported(why: str, allowed: tuple[Any, ...] = (None,)) -> Any:
    """A field accepted only at its default values `allowed`: anything else is a 400 that
    names it as unsupported and says `why`."""
    def check(value: Any) -> Any:
        if not any(value == a and type(value) is type(a) for a in allowed):
            ok = " or ".join(repr(a) for a in allowed).replace("None", "null")
            raise PydanticCustomError("unsupported", "unsupported by meshserve: {why}; "
                                      "allowed is {ok}", {"why": why, "ok": ok})
        return value
    return Annotated[Any, AfterValidator(check)]


Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
LogitBias = dict[Annotated[str, Field(pattern=r"^\d+$")],
                 Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    """What a stream carries besides the choices."""

    include_usage: bool = False
    """Send a last chunk with token usage."""


class JsonSchemaFormat(_Body):
    """response_format.json_schema: a named schema the output must follow."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None
    """Outputs always follow the schema; the flag changes nothing."""


class ResponseFormat(_Body):
    """text (free), json_object (any JSON object) or json_schema (a given schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """Exactly one constraint on the output (extension, as in vLLM)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    """A JSON schema."""
    json_object: bool = False
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    """An EBNF grammar in GBNF form (`root ::= ...`)."""


class SamplingBody(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    """The served model's id (GET /v1/models); null means that one."""
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """Most tokens to generate; null leaves room up to the model's context."""
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    """0 is greedy; null is 1."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    """Nucleus sampling mass; null is 1."""
    top_k: Annotated[int, Field(ge=-1)] | None = None
    """Keep the k most likely tokens; -1 or null keeps all (extension)."""
    n: Annotated[int, Field(ge=1)] = 1
    """Choices to generate per prompt (at most serve.max_n)."""
    stop: Stop | None = None
    """Up to 4 strings that end a choice (cut from its text)."""
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    """Same seed, prompt and parameters: same output."""
    stream: bool = False
    """Server-sent events, one chunk per step."""
    stream_options: StreamOptions | None = None
    """Options of a stream."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (extension)."""
    min_tokens: Annotated[int, Field(ge=0)] = 0
    """Generate at least this many tokens before any stop applies (extension)."""
    return_token_ids: bool = False
    """Add each choice's generated token ids as `token_ids` (extension)."""
    presence_penalty: Penalty | None = None
    """Subtracted from the logit of each token already generated; null is 0."""
    frequency_penalty: Penalty | None = None
    """Subtracted from a token's logit per time it was generated; null is 0."""
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    """Divides positive (multiplies negative) logits of tokens in the prompt or the output;
    null is 1 (extension)."""
    logit_bias: LogitBias | None = None
    """Token id (a string of digits, as in OpenAI's API) -> a bias in [-100, 100]."""
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """Drop tokens less likely than min_p times the most likely one; null is 0 (extension)."""
    user: str | None = None
    """An end-user id: a hint, ignored."""
    response_format: ResponseFormat | None = None
    """json_object or json_schema: the output follows it (structured outputs)."""
    structured_outputs: StructuredOutputsBody | None = None
    """A JSON schema, a regex, a choice of strings or an EBNF grammar (extension)."""
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older names for structured_outputs' fields (extension)."""
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> StructuredOutputs | None:
        """The output's constraint from whichever field gave one; ValueError (a 400) when
        several do or the one given is malformed."""
        given: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise ValueError("response_format.json_schema: required with type "
                                 "'json_schema'; allowed is {name, schema}")
            given.append(("response_format.json_schema.schema", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            kinds = {k: v for k, v in (("json", so.json_), ("regex", so.regex),
                                       ("choice", so.choice), ("grammar", so.grammar))
                     if v is not None}
            if so.json_object:
                kinds["json_object"] = True
            given.append(("structured_outputs", kinds))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append((name, {key: value}))
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(n for n, _ in given)
            raise ValueError(f"{given[1][0]}: a second constraint on the output ({names}); "
                             "allowed is one")
        source, kw = given[0]
        return StructuredOutputs(**kw, source=source)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's params; ValueError names the field."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None
            else self.temperature, top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k, seed=self.seed, stop=stop,
            ignore_eos=self.ignore_eos, logprobs=logprobs, min_tokens=self.min_tokens,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            structured_outputs=self.constraint())

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingBody):
    """POST /v1/completions."""

    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1)] | \
        Annotated[list[TokenIds], Field(min_length=1)]
    """A prompt, token ids, or a batch of either (choices are per prompt, then per n)."""
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """Return each sampled token's logprob and this many top alternatives."""
    best_of: Annotated[int, Field(ge=1)] | None = None
    """Generate this many candidates per prompt (at least n) and return the n with the
    highest cumulative logprob; not with stream."""
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    """Most tokens to generate; null leaves room up to the model's context; 0 (with echo)
    scores the prompt and generates nothing."""
    echo: bool = False
    """Return the prompt before the completion; with logprobs, each prompt token's too
    (None for the first), as evaluation harnesses read them to score text."""
    suffix: unsupported("insertion after a suffix") = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingBody's, scoring the prompt where echo asks for logprobs."""
        params = super().sampling_params(max_tokens, logprobs)
        if self.echo and self.logprobs is not None:
            params = replace(params, prompt_logprobs=self.logprobs)
        return params


class TextPart(_Body):
    """A text part of a message's content."""

    type: Literal["text"]
    text: str


class MediaPart(_Body):
    """An image, audio, video or file part: parsed so the answer can say this model takes
    text only, rather than that the part lacks `text`."""

    type: Literal["image_url", "image", "input_image", "input_audio", "audio_url",
                  "video_url", "file"]


class FunctionCall(_Body):
    """A call an assistant message made: the function's name and its arguments as JSON."""

    name: str
    arguments: str


class ToolCallBody(_Body):
    """One of an assistant message's `tool_calls`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """One message of a conversation."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | MediaPart] | None = None
    """Text, or text parts (joined); other parts are refused (the model takes text)."""
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    """The calls an assistant message made."""
    tool_call_id: str | None = None
    """The call a tool message answers."""

    @property
    def text(self) -> str | None:
        """The content as one string (None when absent)."""
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text content, and each call's arguments
        as an object (templates write them with `tojson`)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text, "name": self.name,
                               "tool_call_id": self.tool_call_id}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                for c in self.tool_calls]
        return out


def _arguments(text: str) -> Any:
    """A call's JSON arguments as an object (the text itself if it is not JSON)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class FunctionDefinition(_Body):
    """A function the model may call."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments."""
    strict: bool | None = None


class ToolDefinition(_Body):
    """One of a request's `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(_Body):
    """tool_choice naming the function to call."""

    class Name(_Body):
        name: str

    type: Literal["function"]
    function: Name


class ChatCompletionRequest(SamplingBody):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    """The conversation so far, rendered with the model's chat template."""
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """OpenAI's newer name for max_tokens (wins when both are given)."""
    logprobs: bool = False
    """Return each sampled token's logprob."""
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """With logprobs: this many top alternatives per token."""
    add_generation_prompt: bool = True
    """End the rendered prompt with the assistant's turn (extension)."""
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    """Functions the model may call: passed to the chat template, and calls in the output
    parsed into the message's `tool_calls` (serve.tool_call_parser)."""
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """none: tools are not offered; auto (the default with tools): the model decides;
    required, or a named function: the output is constrained to calls."""
    parallel_tool_calls: bool | None = None
    """Whether several calls may come in one message (the parser returns all it finds)."""
    documents: list[dict[str, Any]] | None = None
    """Documents for templates that take them (RAG), as transformers passes them
    (extension)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (extension, as in vLLM)."""
    functions: unsupported("function calling (deprecated by tools)") = None
    function_call: unsupported("function calling (deprecated by tools)", (None, "none")) = None
    audio: unsupported("audio output") = None
    modalities: unsupported("output modalities besides text", (None, ["text"])) = None
    prediction: unsupported("predicted outputs") = None
    web_search_options: unsupported("web search") = None
    reasoning_effort: unsupported("reasoning effort (no reasoning model)") = None
    verbosity: unsupported("verbosity (no reasoning model)") = None
    store: unsupported("stored completions", (None, False)) = None
    metadata: dict[str, str] | None = None
    """Tags for stored completions: a hint, ignored."""
    service_tier: Literal["auto", "default"] | None = None
    """A hint, ignored: every request gets the same service."""
    prompt_cache_key: str | None = None
    """A hint, ignored: prefix caching finds shared prefixes itself."""
    safety_identifier: str | None = None
    """An end-user id: a hint, ignored."""
