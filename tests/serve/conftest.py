"""A real `meshserve serve` process on a free loopback port, killed and reaped by the test."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from meshserve.engine.llm import LLM

# Small enough that fuzzed max_tokens / n stay cheap, large enough for real prompts.
ENGINE_OVERRIDES = ["threads=1", "parallel=single", "engine.max_model_len=256"]
MODEL = "meshcoder"


class ServerProcess:
    """`meshserve serve` in its own process group; `stop()` kills and reaps all of it."""

    def __init__(self, overrides: list[str], log_path: Path, env: dict[str, str] | None = None,
                 startup_s: float = 120.0, model: list[str] | None = None) -> None:
        """`model`: the arguments naming the model, right after the verb (a directory or
        a preset as the first argument, or overrides); the bundled preset by default."""
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "meshserve.launch.cli", "serve",
               *(model if model is not None else [f"model={MODEL}"]), "serve.port=0",
               *overrides]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        try:
            self.url = self._wait_ready(startup_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if url is None:
                m = re.search(r"listening on (http://[\d.]+:\d+)", self.log())
                url = m.group(1) if m else None
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        """Everything the server printed so far."""
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """/metrics as {name{labels}: value} (comments dropped), and each series also
        summed over its replicas under its name without the replica and role labels
        (what `sum without (replica, role)` gives)."""
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10.0).text)

    def wait_idle(self, timeout_s: float = 30.0) -> dict[str, float]:
        """Wait until nothing runs or waits and every KV block is free; the metrics then."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            idle = (m["meshserve_num_requests_running"] == 0
                    and m["meshserve_num_requests_waiting"] == 0
                    and m["meshserve_kv_blocks_used"] == 0
                    and m["meshserve_kv_blocks_free"] == m["meshserve_kv_blocks_total"]
                    and m["meshserve_open_streams"] == 0)
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.1)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM, then SIGKILL the whole group; reap; return the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(self.proc.pid)
        code = self.proc.wait(10.0)
        self._log.close()
        return code


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {name{labels}: value}, plus the sums over replica and role."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
            m = re.fullmatch(r"(\w+)\{(.*)\}", series)
            if m is None:
                continue
            labels = [kv for kv in re.findall(r'\w+="[^"]*"', m.group(2))
                      if not kv.startswith(("replica=", "role="))]
            if len(labels) < m.group(2).count('="'):
                key = m.group(1) + (f"{{{','.join(labels)}}}" if labels else "")
                out[key] = out.get(key, 0.0) + float(value)
    return out


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (zombies excluded)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="session")
def process_group() -> Callable[[int], list[int]]:
    """process_group(pgid) -> the live pids of that process group."""
    return group_pids


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One plain (tp=1) server shared by the tests of this folder."""
    srv = ServerProcess([*ENGINE_OVERRIDES, "serve.log_interval_s=1"],
                        tmp_path_factory.mktemp("serve") / "server.log")
    yield srv
    code = srv.stop()
    # uvicorn shuts down gracefully, then re-raises the signal: a clean stop reads -SIGTERM.
    assert code in (0, -signal.SIGTERM), f"exit code {code} after SIGTERM:\n{srv.log()[-3000:]}"
    assert group_pids(srv.proc.pid) == [], "server processes left behind"


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """start_server(overrides, env=None, model=None) -> a server of its own; stopped and
    reaped at the end."""
    started: list[ServerProcess] = []

    def start(overrides: list[str], env: dict[str, str] | None = None,
              model: list[str] | None = None) -> ServerProcess:
        srv = ServerProcess(overrides, tmp_path / f"server{len(started)}.log", env,
                            model=model)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
        assert group_pids(srv.proc.pid) == [], "server processes left behind"


@pytest.fixture(scope="session")
def offline() -> Iterator[LLM]:
    """The offline API on the same model and engine settings as `server`."""
    llm = LLM(MODEL, ENGINE_OVERRIDES, progress=False)
    yield llm
    llm.shutdown()
