"""`meshserve serve`: the OpenAI-compatible HTTP server.

    meshserve serve model=meshcoder serve.port=8000 [parallel.tp=2 ...]

Loads the model (self-spawning ranks when parallel.tp / pp > 1; under torchrun every
rank runs this and all but rank 0 serve rank 0), binds serve.host:serve.port (0: a free
port), prints `meshserve serve: listening on http://HOST:PORT` and serves until SIGINT /
SIGTERM (exit 0) or until the engine fails, e.g. a rank dies (503s for
serve.failure_exit_s, then exit 1).
"""

from __future__ import annotations

import logging
import os
import socket
import sys

import uvicorn

from meshserve.engine.llm import LLM
from meshserve.launch.cli_config import load_config
from meshserve.parallel.comm.ranks import RankFailure
from meshserve.serve.app import create_app
from meshserve.serve.async_engine import SHUTTING_DOWN, AsyncEngine
from meshserve.serve.metrics import ServerMetrics
from meshserve.serve.serve_config import API_KEY_ENV

GRACEFUL_SHUTDOWN_S = 5.0
"""How long open connections may finish once the server stops."""


def run(overrides: list[str]) -> int:
    """Serve until stopped; 0 on a clean stop, 1 when the engine or a rank failed."""
    cfg = load_config(overrides)
    sc = cfg.serve
    _setup_logging()
    try:
        llm = LLM(config=cfg.runtime, progress=False, min_replicas=sc.min_replicas)
    except RankFailure as e:
        print(f"meshserve serve: {e}", file=sys.stderr)
        return 1
    engine = llm.engine
    # (its callbacks look `metrics` and `server` up when called: the engine thread starts
    # with the server, once both exist)
    async_engine = AsyncEngine(
        engine, max_pending=sc.max_pending_requests, health_interval_s=sc.health_interval_s,
        on_outputs=lambda outs: metrics.on_outputs(outs),
        on_failure=lambda message: _exit_soon(async_engine, server, message,
                                              sc.failure_exit_s))
    metrics = ServerMetrics(lambda: async_engine.stats, lambda: async_engine.replicas,
                            lambda: async_engine.num_routes,
                            lambda: getattr(engine, "transfers", None))
    model_names = sc.model_names(cfg.model.label)
    app = create_app(async_engine, metrics, sc, model_names,
                     api_key=sc.api_key or os.environ.get(API_KEY_ENV) or None)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=sc.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        access_log=sc.log_level in ("info", "debug", "trace")))
    try:
        sock = _bind(sc.host, sc.port)
    except OSError as e:
        async_engine.shutdown()
        raise ValueError(f"serve.host/serve.port={sc.host}:{sc.port}: cannot bind ({e})") \
            from None
    host, port = sock.getsockname()[:2]
    print(f"meshserve serve: listening on http://{host}:{port} (model {', '.join(repr(n) for n in model_names)}, "
          f"{engine.num_blocks} KV blocks, max_model_len {engine.max_model_len})", flush=True)
    server.run(sockets=[sock])
    if async_engine.failure not in (None, SHUTTING_DOWN):
        print(f"meshserve serve: {async_engine.failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def _exit_soon(engine: AsyncEngine, server: uvicorn.Server, message: str, delay_s: float) -> None:
    """On the engine thread after a failure: stop the server after `delay_s` of 503s."""
    logging.getLogger("meshserve.serve").error("%s; exiting in %.1f s", message, delay_s)
    assert engine.loop is not None

    def stop() -> None:
        server.should_exit = True

    try:
        engine.loop.call_soon_threadsafe(engine.loop.call_later, delay_s, stop)
    except RuntimeError:  # the loop is already closed: the server is stopping anyway
        server.should_exit = True


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _setup_logging() -> None:
    logger = logging.getLogger("meshserve.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s meshserve serve: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False

