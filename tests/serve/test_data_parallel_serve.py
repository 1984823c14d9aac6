"""`meshserve serve parallel.dp=2`: two replicas behind one OpenAI server; concurrent
requests all answered, the KV blocks of both counted, nothing left after a stop."""

from __future__ import annotations

import os
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


def _replica_pid(srv, process_group) -> int:  # noqa: ANN001
    (pid,) = [p for p in process_group(srv.proc.pid) if p != srv.proc.pid]
    return pid


def test_a_killed_replica_degrades_the_server_and_the_survivor_serves_on(
        start_server, process_group) -> None:
    srv = start_server(["threads=1", "engine.max_model_len=1024", "parallel.dp=2",
                        "parallel.router=round_robin"])
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok", "replicas": [
        {"replica": 0, "role": "colocated", "status": "up"},
        {"replica": 1, "role": "colocated", "status": "up"}]}
    long = {**BODY, "max_tokens": 900}  # still running at the kill, however fast decoding is
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, f"{srv.url}/v1/completions", json=long, timeout=120)
                   for _ in range(4)]
        deadline = time.monotonic() + 60
        while srv.metrics().get(  # both of replica 1's requests
                'meshserve_num_requests_running{replica="1",role="colocated"}', 0) < 2:
            assert time.monotonic() < deadline, srv.log()[-3000:]
            time.sleep(0.1)
        os.kill(_replica_pid(srv, process_group), signal.SIGKILL)
        resps = [f.result() for f in futures]
    codes = sorted(r.status_code for r in resps)
    assert codes == [200, 200, 503, 503], [r.text for r in resps]
    lost = [r.json()["error"]["message"] for r in resps if r.status_code == 503]
    assert all("data-parallel replica 1" in m and "lost with it" in m for m in lost), lost
    health = httpx.get(f"{srv.url}/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded"
    assert [(r["replica"], r["status"]) for r in body["replicas"]] == [(0, "up"), (1, "down")]
    assert "exited" in body["replicas"][1]["reason"]
    # New requests all go to the survivor; nothing is left on it afterwards.
    again = [httpx.post(f"{srv.url}/v1/completions", json=BODY, timeout=60) for _ in range(3)]
    assert [r.status_code for r in again] == [200] * 3
    m = srv.wait_idle()
    assert m['meshserve_replica_up{replica="0",role="colocated"}'] == 1
    assert m['meshserve_replica_up{replica="1",role="colocated"}'] == 0
    assert m['meshserve_kv_blocks_used{replica="0",role="colocated"}'] == 0
    assert m['meshserve_requests_failed_total{replica="1",role="colocated"}'] == 2
    assert m['meshserve_requests_finished_total{finish_reason="length"}'] == 5
    assert process_group(srv.proc.pid) == [srv.proc.pid]


def test_below_min_replicas_the_server_exits(start_server, process_group) -> None:
    srv = start_server(["threads=1", "engine.max_model_len=256", "parallel.dp=2",
                        "serve.min_replicas=2"])
    os.kill(_replica_pid(srv, process_group), signal.SIGKILL)
    assert srv.proc.wait(30) == 1
    assert "1 of 2 replicas left, 2 needed" in srv.log()
