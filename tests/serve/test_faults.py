"""A worker rank killed under TP=2: streams end with a 503 error, new requests get 503,
/health says why, and the server exits non-zero in bounded time (never hangs)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

BODY = {"model": "meshcoder", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}


def worker_ranks(pgid: int, process_group) -> list[int]:  # noqa: ANN001 - conftest's
    pids = []
    for pid in process_group(pgid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"meshserve.engine.executor.rank" in cmd:
            pids.append(pid)
    return pids


@pytest.mark.slow
def test_killed_rank_gives_503_and_a_nonzero_exit(start_server, process_group) -> None:
    srv = start_server(["threads=1", "engine.max_model_len=256", "parallel.tp=2",
                        "parallel.timeout_s=20", "serve.failure_exit_s=3"])
    assert httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=60).status_code == 200
    (rank1,) = worker_ranks(srv.proc.pid, process_group)
    long = {**BODY, "max_tokens": 200, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=long, timeout=60) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                break
        os.kill(rank1, signal.SIGKILL)
        t_kill = time.monotonic()
        events = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]"
                  for x in lines if x.startswith("data: ")]
    assert "[DONE]" not in events
    err = events[-1]["error"]
    assert err["code"] is None and "rank 1" in err["message"], err
    assert time.monotonic() - t_kill < 30
    resp = httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=30)
    assert resp.status_code == 503 and "rank 1" in resp.json()["error"]["message"], resp.text
    health = httpx.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
    code = srv.proc.wait(timeout=30)
    assert code == 1, srv.log()[-3000:]
    assert "rank 1" in srv.log()


@pytest.mark.slow
def test_rank_killed_while_idle_is_noticed_without_a_request(start_server,
                                                             process_group) -> None:
    srv = start_server(["threads=1", "engine.max_model_len=256", "parallel.tp=2",
                        "serve.failure_exit_s=0", "serve.health_interval_s=0.2"])
    (rank1,) = worker_ranks(srv.proc.pid, process_group)
    os.kill(rank1, signal.SIGKILL)
    code = srv.proc.wait(timeout=30)
    assert code == 1, srv.log()[-3000:]
    assert "engine failed: rank 1 was killed" in srv.log()
