"""A model's chat template rendered as transformers renders it, in a sandbox.

Published templates are Jinja programs shipped inside model directories, so they are
untrusted code: they run in jinja2's `ImmutableSandboxedEnvironment`, which refuses
attribute access to Python internals (`__globals__`, `__subclasses__`, ...) and any
mutation of the objects passed in. The environment offers what templates written for
transformers call: `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII
text and takes `indent`, `separators` and `sort_keys`, `namespace` (no underscore
attributes), `dict`, and the loop controls `break` / `continue`. A template sees
`messages`, `tools`, `documents`, `add_generation_prompt` and the tokenizer's special
tokens (`bos_token`, `eos_token`, ...).

Where a tokenizer ships several named templates (`[{"name": ..., "template": ...}]`), a
request with tools takes `tool_use` and any other `default`, as transformers chooses.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that cannot render these messages: the template's own complaint
    (`raise_exception`), a refused reach into Python internals, or a Jinja error."""


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` whose attributes may not start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's own trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attribute(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"a namespace attribute may not start with '_' (got {name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, failing at the first unsafe attribute it meets (jinja2
    itself hands back an undefined value that prints as nothing)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to {attribute!r} of a {type(obj).__name__} is unsafe")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace, dict=_make_dict)
    return env


def _plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (str subclasses and the like stripped), so a
    template sees no object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


class ChatTemplate:
    """One tokenizer's chat template(s), compiled once."""

    def __init__(self, source: str | Sequence[Mapping[str, str]],
                 special_tokens: Mapping[str, str] | None = None) -> None:
        """`source`: a template, or transformers' list of named templates."""
        named = ({"default": source} if isinstance(source, str)
                 else {t["name"]: t["template"] for t in source})
        if "default" not in named and len(named) == 1:
            named = {"default": next(iter(named.values()))}
        env = _environment()
        try:
            self._templates = {name: env.from_string(text) for name, text in named.items()}
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template: does not compile (line {e.lineno}: "
                                    f"{e.message})") from None
        self.special_tokens = dict(special_tokens or {})

    @property
    def names(self) -> list[str]:
        return list(self._templates)

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of `messages` (keys whose value is None dropped, as transformers
        drops them). ChatTemplateError says why a template refused them."""
        template = self._templates.get("tool_use" if tools else "default") \
            or self._templates.get("default")
        if template is None:
            raise ChatTemplateError(f"chat template: none named 'default' among {self.names}")
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context = {**self.special_tokens, **_plain(kwargs)}
        try:
            return template.render(messages=_plain(chat), tools=_plain(tools),
                                   documents=_plain(documents),
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template: refused ({e}): a template may not reach "
                                    "Python internals or change its inputs") from None
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e.message or type(e).__name__}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError,
                ZeroDivisionError) as e:
            raise ChatTemplateError(f"chat template: failed on these messages "
                                    f"({type(e).__name__}: {e})") from None
