"""Errors as OpenAI's JSON error body, each message starting with the field it is about."""

from __future__ import annotations

import re
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 413: "invalid_request_error",
               503: "service_unavailable"}


class APIError(Exception):
    """An error answer: HTTP status, message (naming the field) and that field."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def unknown_model(name: str, served: list[str]) -> APIError:
    """The 404 for a model id this server does not serve (OpenAI's model_not_found)."""
    allowed = ", ".join(repr(n) for n in served)
    return APIError(404, f"model: {name!r} is not served; allowed: {allowed}", "model",
                    "model_not_found")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """{"error": {message, type, param, code}} as OpenAI sends it: `code` a short string
    where OpenAI has one (model_not_found, invalid_api_key), else null."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def from_value_error(e: ValueError) -> APIError:
    """A 400 from the engine's or SamplingParams' ValueError ('field=...' or 'field: ...')."""
    text = str(e)
    match = re.match(r"[A-Za-z_][\w.]*", text)
    return APIError(400, text, match.group(0) if match else None)


TYPE_MISMATCH = ("_type", "_parsing", "literal_error", "union_tag")
"""Endings of pydantic error types that say 'not this kind of value': for a union field one
comes from every member the value is not, so they explain less than a value error does."""


def _describe(errors: list[Any]) -> tuple[str, str | None]:
    """One message from pydantic's errors: the field first, then the most telling error.

    A union field (a prompt may be text, token ids or a batch of either) fails once per
    member; the error that explains most is a value error (a negative token id) over a
    type mismatch, and the deepest one (an index inside the list) over a shallow one."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid body"}
    if first.get("type") == "json_invalid":
        return f"body: malformed JSON ({first.get('ctx', {}).get('error', 'parse error')})", \
            "body"
    fields = list(dict.fromkeys(_where(e).split(".")[0] or "body" for e in errors))
    return "; ".join(_field_message(f, errors) for f in fields), fields[0]


def _field_message(field: str, errors: list[Any]) -> str:
    """The most telling of one field's errors, as 'where: what (got value)'."""
    same = [e for e in errors if (_where(e).split(".")[0] or "body") == field]
    best = max(same, key=lambda e: (not str(e.get("type", "")).endswith(TYPE_MISMATCH),
                                    len(e.get("loc", ()))))
    got = f" (got {best['input']!r})" if "input" in best and _short(best["input"]) else ""
    return f"{_where(best) or field}: {best.get('msg', 'invalid')}{got}"


def _where(error: Any) -> str:
    """The error's location as fields and indices (union members' type names left out)."""
    loc = [str(p) for p in error.get("loc", ()) if p != "body"]
    return ".".join(p for p in loc if p.isidentifier() or p.isdigit())


def _short(value: Any) -> bool:
    """Whether `value` is small enough to quote back in a message."""
    return isinstance(value, int | float | bool | str) and len(repr(value)) <= 40


def install(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """Answer validation errors, APIError and HTTP errors with OpenAI error bodies."""

    def respond(status: int, message: str, param: str | None,
                headers: dict[str, str] | None = None, code: str | None = None
                ) -> JSONResponse:
        on_error(status)
        return JSONResponse(error_body(status, message, param, code), status_code=status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe(list(exc.errors()))
        return respond(400, message, param)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return respond(exc.status, exc.message, exc.param, headers, exc.code)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        text = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        param = "body" if "body" in text.lower() else None
        return respond(exc.status_code, f"{param}: {text}" if param else text, param)
