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

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """{"error": {message, type, param, code}} as OpenAI sends it."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def from_value_error(e: ValueError) -> APIError:
    """A 400 from the engine's or SamplingParams' ValueError ('field=...' or 'field: ...')."""
    text = str(e)
    match = re.match(r"[A-Za-z_][\w.]*", text)
    return APIError(400, text, match.group(0) if match else None)


def _describe(errors: list[Any]) -> tuple[str, str | None]:
    """One message from pydantic's errors: the first error, its field first."""
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid body"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"body: malformed JSON ({first.get('ctx', {}).get('error', 'parse error')})", \
            "body"
    param = loc[0] if loc else "body"
    # Union members appear in the location as type names; keep fields and indices only.
    where = ".".join(p for p in loc if p.isidentifier() or p.isdigit())
    extra = f" ({len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where or param}: {first.get('msg', 'invalid')}{extra}", param


def install(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """Answer validation errors, APIError and HTTP errors with OpenAI error bodies."""

    def respond(status: int, message: str, param: str | None,
                headers: dict[str, str] | None = None) -> JSONResponse:
        on_error(status)
        return JSONResponse(error_body(status, message, param), status_code=status,
                            headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe(list(exc.errors()))
        return respond(400, message, param)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
        return respond(exc.status, exc.message, exc.param, headers)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSONResponse:
        text = exc.detail if isinstance(exc.detail, str) else HTTPStatus(exc.status_code).phrase
        param = "body" if "body" in text.lower() else None
        return respond(exc.status_code, f"{param}: {text}" if param else text, param)
