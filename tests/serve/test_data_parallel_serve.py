"""`meshserve serve parallel.dp=2`: two replicas behind one OpenAI server; concurrent
requests all answered, the KV blocks of both counted, nothing left after a stop."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow

BODY = {"model": "meshcoder", "prompt": "def f(x):", "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


def test_two_replicas_serve_concurrent_requests(start_server, process_group) -> None:
    srv = start_server(["threads=1", "engine.max_model_len=256", "parallel.dp=2"])
    single = httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=60).json()
    with ThreadPoolExecutor(6) as pool:
        resps = list(pool.map(lambda _: httpx.post(f"{srv.url}/v1/completions", json=BODY,
                                                   timeout=120), range(6)))
    assert [r.status_code for r in resps] == [200] * 6
    # Greedy: every replica gives the text one replica gave.
    assert {r.json()["choices"][0]["text"] for r in resps} == {single["choices"][0]["text"]}
    m = srv.wait_idle()
    assert m["meshserve_kv_blocks_used"] == 0
    assert len(process_group(srv.proc.pid)) == 2  # the server and its second replica
    srv.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal: a clean stop reads -SIGTERM.
    assert srv.proc.wait(30) in (0, -signal.SIGTERM), srv.log()[-3000:]
    deadline = time.monotonic() + 15
    while process_group(srv.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process_group(srv.proc.pid) == [], "the second replica outlived the server"
