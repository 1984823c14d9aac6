"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from meshserve.validation import require

MAX_LOGIT_BIAS = 100.0
"""OpenAI's bound on a logit_bias value (either sign)."""


@dataclass(frozen=True, kw_only=True)
class StructuredOutputs:
    """The output constrained to exactly one of: a JSON schema, any JSON object, a regular
    expression, one of several strings, or an EBNF grammar (GBNF: `root ::= ...`)."""

    json: Mapping[str, Any] | str | None = None
    """A JSON schema (an object, or its JSON text); stored as JSON text."""
    json_object: bool = False
    """Any JSON object."""
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    source: str = field(default="structured_outputs", compare=False)
    """The request field these came from, named by the errors about them."""

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] * bool(self.json_object)
        require(len(kinds) == 1, self.source, kinds or None,
                "exactly one of json, json_object, regex, choice, grammar")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{self.source}.json: not JSON ({e}); allowed is a JSON "
                                     "schema") from None
            require(isinstance(schema, Mapping), f"{self.source}.json", type(schema).__name__,
                    "a JSON schema object")
            object.__setattr__(self, "json", json.dumps(schema))  # key order kept: it is
            # the order the properties are generated in
        if self.choice is not None:
            require(not isinstance(self.choice, str) and len(self.choice) >= 1
                    and all(isinstance(c, str) and c for c in self.choice),
                    f"{self.source}.choice", self.choice, "a list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            require(value is None or (isinstance(value, str) and bool(value)),
                    f"{self.source}.{name}", value, "a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar")
                    if getattr(self, k) is not None)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick each next token and when to stop."""

    max_tokens: int = 16
    """Most tokens to generate."""

    temperature: float = 1.0
    """0 means greedy."""

    top_k: int = -1
    """Keep the k most likely tokens; -1 keeps all."""

    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""

    seed: int | None = None
    """Per-request seed: the same seed and prompt give the same output."""

    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the sequence (kept in the output)."""

    stop: tuple[str, ...] = ()
    """Strings that end the sequence (cut from the text)."""

    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""

    logprobs: int | None = None
    """Return the log-probability of each sampled token and of this many top tokens."""

    prompt_logprobs: int | None = None
    """Return the log-probability of each prompt token after the first, and of this many
    top tokens at each prompt position (`RequestOutput.prompt_logprobs`). Such a request
    computes its whole prompt: it takes no prefix-cache hit (its blocks still enter the
    cache for others)."""

    min_tokens: int = 0
    """Generate at least this many tokens before any stop condition applies."""

    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (after temperature)."""

    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI's semantics)."""

    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was already generated."""

    repetition_penalty: float = 1.0
    """Divides positive logits (multiplies negative ones) of tokens in the prompt or the
    output so far (the CTRL paper's and transformers' semantics); 1 is off."""

    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    """Token id -> a bias added to its logit before sampling, in [-100, 100]; stored as
    sorted (id, bias) pairs."""

    structured_outputs: StructuredOutputs | None = None
    """Constrain the output to a grammar (the sampler masks every other token)."""

    extra: dict[str, object] = field(default_factory=dict, compare=False)
    """Unused by the engine; carried through for callers."""

    @property
    def logit_bias_items(self) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs, as __post_init__ leaves it."""
        return cast("tuple[tuple[int, float], ...]", self.logit_bias)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        require(all(isinstance(kv, (tuple, list)) and len(kv) == 2 for kv in pairs),
                "logit_bias", bias, "a mapping of token id to bias")
        object.__setattr__(self, "logit_bias", tuple(tuple(kv) for kv in pairs))
        require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
                "an int >= 1")
        require(_is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature",
                self.temperature, "a number in [0, 100]")
        require(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k",
                self.top_k, "-1 (off) or an int >= 1")
        require(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p,
                "a number in (0, 1]")
        require(self.seed is None or _is_int(self.seed), "seed", self.seed, "null or an int")
        require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                self.stop_token_ids, "non-negative ints")
        require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
                "non-empty strings")
        require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
                "logprobs", self.logprobs, "null or an int in [0, 20]")
        require(self.prompt_logprobs is None
                or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
                "prompt_logprobs", self.prompt_logprobs, "null or an int in [0, 20]")
        require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                "min_tokens", self.min_tokens, f"an int in [0, max_tokens={self.max_tokens}]")
        require(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p,
                "a number in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            require(_is_num(value) and -2.0 <= value <= 2.0, name, value, "a number in [-2, 2]")
        require(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
                "repetition_penalty", self.repetition_penalty, "a number in (0, 2]")
        for token, value in self.logit_bias_items:
            require(_is_int(token) and token >= 0, "logit_bias", token,
                    "non-negative int token ids as keys")
            require(_is_num(value) and abs(value) <= MAX_LOGIT_BIAS, f"logit_bias[{token}]",
                    value, f"a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias)))
        so = self.structured_outputs
        require(so is None or isinstance(so, StructuredOutputs), "structured_outputs", so,
                "null or a StructuredOutputs")

    @property
    def penalized(self) -> bool:
        """Whether a penalty reads the tokens this sequence has seen."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Whether the next token is always the most likely one."""
        return self.temperature == 0.0 or self.top_k == 1


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


@dataclass(frozen=True, slots=True)
class SequenceSampling:
    """What the sampling rank learns of a sequence the first time a step carries it."""

    params: SamplingParams
    prompt_token_ids: tuple[int, ...] = ()
    """The prompt, sent only where a penalty reads it (repetition_penalty != 1)."""
