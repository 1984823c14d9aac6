"""The FastAPI app: OpenAI routes, /health, /metrics, auth, body checks, the OpenAPI schema."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST

from meshserve.engine.client import ReplicaState
from meshserve.serve.async_engine import AsyncEngine, EngineDeadError
from meshserve.serve.errors import APIError, error_body, install, unknown_model
from meshserve.serve.metrics import ServerMetrics
from meshserve.serve.openai_serving import OpenAIServing
from meshserve.serve.protocol import ChatCompletionRequest, CompletionRequest
from meshserve.serve.serve_config import ServeConfig

MAX_BODY_BYTES = 8 << 20
log = logging.getLogger("meshserve.serve")


class _CheckedBodyRoute(APIRoute):
    """Rejects oversized and non-UTF-8 bodies, naming `body`, before JSON parsing."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if request.method == "POST":
                body = await request.body()  # cached: the handler reads it again
                if len(body) > MAX_BODY_BYTES:
                    raise APIError(413, f"body: {len(body)} bytes; allowed is at most "
                                        f"{MAX_BODY_BYTES}", "body")
                try:
                    body.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise APIError(400, f"body: not UTF-8 (invalid byte at offset {e.start}); "
                                        "allowed is UTF-8 JSON", "body") from None
            return await handler(request)

        return checked


_BEARER = HTTPBearer(auto_error=False)


class _APIKeyCheck:
    """The dependency requiring `Authorization: Bearer <api_key>`."""

    def __init__(self, api_key: str) -> None:
        self.api_key = api_key.encode()

    async def __call__(
            self, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)]
    ) -> None:
        if creds is None:
            raise APIError(401, "authorization: missing; allowed is 'Bearer <api key>'",
                           "authorization", "invalid_api_key")
        if not hmac.compare_digest(creds.credentials.encode(), self.api_key):
            raise APIError(401, "authorization: wrong API key", "authorization",
                           "invalid_api_key")


def _auth(api_key: str | None) -> list[Any]:
    """The /v1 routes' dependencies: the API key check when there is a key."""
    return [] if api_key is None else [Depends(_APIKeyCheck(api_key))]


def create_app(engine: AsyncEngine, metrics: ServerMetrics, cfg: ServeConfig,
               model_names: list[str],
               api_key: str | None = None) -> FastAPI:
    """The server's app. Its lifespan starts the engine thread and the metric log line,
    and shuts the engine (and its ranks) down at the end."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start(asyncio.get_running_loop())
        ticker = asyncio.ensure_future(_log_metrics(metrics, cfg.log_interval_s))
        try:
            yield
        finally:
            ticker.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = _App(model_names, cfg, title="meshserve", version="0.1.0", lifespan=lifespan,
               description="OpenAI-compatible completions and chat over meshserve's engine.")
    install(app, lambda status: metrics.errors.labels(str(status)).inc())
    serving = OpenAIServing(engine, model_names, cfg, metrics)
    v1 = APIRouter(prefix="/v1", route_class=_CheckedBodyRoute, dependencies=_auth(api_key))

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """Complete a prompt (or a batch of prompts)."""
        return await serving.completions(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """Answer a conversation, rendered with the model's chat template."""
        return await serving.chat(body, request)

    created = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "meshserve",
                "max_model_len": serving.max_model_len}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        """The served model, once under each of its names."""
        return {"object": "list", "data": [model_card(name) for name in model_names]}

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        """One of the served model's names (the openai client's models.retrieve)."""
        if model_id not in model_names:
            raise unknown_model(model_id, model_names)
        return model_card(model_id)

    app.include_router(v1)

    @app.post("/reset_prefix_cache", dependencies=_auth(api_key))
    async def reset_prefix_cache() -> dict[str, int]:
        """Uncache every KV block no request holds, so the next benchmark run starts cold."""
        try:
            return {"num_blocks_uncached": await engine.reset_prefix_cache()}
        except EngineDeadError as e:
            raise APIError(503, str(e)) from None

    @app.get("/health")
    async def health() -> Response:
        """200 while the engine serves: status 'ok', or 'degraded' with the replicas that
        are down (the others serve on); 503 with the reason once it has failed."""
        if engine.failure is not None:
            return JSONResponse(error_body(503, engine.failure), status_code=503)
        return JSONResponse(health_body(engine.replicas))

    @app.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text format."""
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _App(FastAPI):
    """FastAPI whose OpenAPI schema carries this server's limits: the model's names, and
    n <= serve.max_n."""

    def __init__(self, model_names: list[str], cfg: ServeConfig, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_names, self.cfg = model_names, cfg

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema:
            return self.openapi_schema
        schema = get_openapi(title=self.title, version=self.version,
                             description=self.description, routes=self.routes)
        for name in ("CompletionRequest", "ChatCompletionRequest"):
            props = schema["components"]["schemas"][name]["properties"]
            props["model"]["anyOf"] = [{"type": "string", "enum": list(self.model_names)},
                                       {"type": "null"}]
            props["n"]["maximum"] = self.cfg.max_n
        self.openapi_schema = schema
        return schema


def health_body(replicas: list[ReplicaState]) -> dict[str, Any]:
    """/health's answer while serving; with several replicas, each one's state."""
    down = [r for r in replicas if not r.up]
    body: dict[str, Any] = {"status": "degraded" if down else "ok"}
    if len(replicas) > 1:
        body["replicas"] = [{"replica": r.index, "role": r.role,
                             "status": "up" if r.up else "down",
                             **({"reason": r.down} if r.down else {})} for r in replicas]
    return body


async def _log_metrics(metrics: ServerMetrics, interval_s: float) -> None:
    """Refresh the tokens/s gauges and log the metric line every interval (10 s when off)."""
    while True:
        await asyncio.sleep(interval_s or 10.0)
        line = metrics.tick()
        if interval_s:
            log.info(line)
