"""What `meshserve serve` listens on and how it guards and reports itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshserve.serve.tool_calls import PARSERS
from meshserve.validation import require

API_KEY_ENV = "MESHSERVE_API_KEY"
"""Read when serve.api_key is null, so the key need not appear on a command line."""


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Options of `meshserve serve`."""

    host: str = "127.0.0.1"
    """Address to bind; loopback unless told otherwise."""
    port: int = 8000
    """TCP port; 0 picks a free one (printed on the 'listening on' line)."""
    api_key: str | None = None
    """Bearer token required on /v1/*; null reads $MESHSERVE_API_KEY, unset means open."""
    served_model_name: Any = None
    """The model id clients ask for: one name or a list of aliases (the first is the one
    responses carry unless a request names another); null: the model as given (model.path
    when set, else the preset's name)."""
    max_n: int = 16
    """Most choices (n) per request."""
    max_batch_prompts: int = 64
    """Most prompts in one /v1/completions request."""
    max_pending_requests: int = 4096
    """Engine requests (choices) queued or running; beyond it new ones get 503."""
    log_interval_s: float = 10.0
    """Seconds between metric log lines; 0 turns them off."""
    health_interval_s: float = 0.5
    """How often an idle engine checks that its ranks are alive."""
    min_replicas: int = 1
    """With data-parallel replicas: the server keeps serving (degraded, /health says which
    replica is down) while at least this many are up; below it, it fails and exits."""
    failure_exit_s: float = 1.0
    """After the engine fails: seconds of 503 answers before the process exits non-zero."""
    log_level: str = "warning"
    """uvicorn's log level (access logs show at 'info')."""
    tool_call_parser: str = "auto"
    """How tool calls are read from the output: hermes (`<tool_call>` JSON blocks), none
    (requests with tools get a 400), or auto: hermes where the chat template uses that
    format, else none."""

    def __post_init__(self) -> None:
        require(bool(self.host), "serve.host", self.host, "an address such as 127.0.0.1")
        require(0 <= self.port <= 65535, "serve.port", self.port, "0..65535 (0: any free port)")
        require(self.api_key is None or bool(self.api_key), "serve.api_key", self.api_key,
                "null or a non-empty string")
        names = self.served_model_name
        require(names is None or (isinstance(names, str) and bool(names))
                or (isinstance(names, list | tuple) and bool(names)
                    and all(isinstance(n, str) and n for n in names)),
                "serve.served_model_name", names, "null, a name, or a list of names")
        require(1 <= self.max_n <= 1024, "serve.max_n", self.max_n, "an int in [1, 1024]")
        require(self.max_batch_prompts >= 1, "serve.max_batch_prompts", self.max_batch_prompts,
                "an int >= 1")
        require(self.max_pending_requests >= 1, "serve.max_pending_requests",
                self.max_pending_requests, "an int >= 1")
        require(self.log_interval_s >= 0, "serve.log_interval_s", self.log_interval_s,
                "seconds >= 0 (0: off)")
        require(self.health_interval_s > 0, "serve.health_interval_s", self.health_interval_s,
                "seconds > 0")
        require(self.min_replicas >= 1, "serve.min_replicas", self.min_replicas,
                "an int >= 1 (at most parallel.dp)")
        require(self.failure_exit_s >= 0, "serve.failure_exit_s", self.failure_exit_s,
                "seconds >= 0")
        parsers = ("auto", "none", *PARSERS)
        require(self.tool_call_parser in parsers, "serve.tool_call_parser",
                self.tool_call_parser, f"one of {parsers}")
        levels = ("critical", "error", "warning", "info", "debug", "trace")
        require(self.log_level in levels, "serve.log_level", self.log_level, f"one of {levels}")

    def model_names(self, default: str) -> list[str]:
        """The names the model is served under: served_model_name, else `default`."""
        names = self.served_model_name
        if names is None:
            return [default]
        return [names] if isinstance(names, str) else list(names)
