"""`meshserve serve disagg=manual`: a prefill and a decode replica behind one OpenAI
server; the same greedy text as colocated, streamed or not, roles in /health, the KV
transfers in /metrics, no block held afterwards."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n    " + "# compute the n-th Fibonacci number, iteratively\n    " * 3
BODY = {"model": "meshcoder", "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True}
SERVER = ["threads=1", "engine.max_model_len=256", "engine.block_size=8"]


def _text(url: str, body: dict) -> str:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _streamed(url: str, body: dict) -> str:
    parts = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)


def test_prefill_and_decode_replicas_serve_like_one(start_server) -> None:
    colocated = start_server(SERVER)
    want = _text(colocated.url, BODY)
    colocated.stop()
    srv = start_server([*SERVER, "disagg=manual", "disagg.min_prefill_tokens=16"])
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok", "replicas": [
        {"replica": 0, "role": "prefill", "status": "up"},
        {"replica": 1, "role": "decode", "status": "up"}]}
    assert _text(srv.url, BODY) == want
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda i: _streamed(srv.url, {**BODY, "prompt": f"{i}" + PROMPT}),
                              range(3)))
    assert all(len(t) > 0 for t in texts)
    m = srv.wait_idle()
    assert m["meshserve_kv_transfers_total"] >= 1
    assert m["meshserve_kv_transfer_bytes_total"] > 0
    assert m["meshserve_kv_transfers_failed_total"] == 0
    assert m["meshserve_kv_transfer_seconds_count"] == m["meshserve_kv_transfers_total"]
    assert m['meshserve_kv_blocks_used{replica="0",role="prefill"}'] == 0
    assert m['meshserve_kv_blocks_used{replica="1",role="decode"}'] == 0
    assert m['meshserve_generation_tokens_total{replica="1",role="decode"}'] > 0
    # TTFT split: the queue and prefill on the prefill replica, the request ended on decode.
    done = m['meshserve_requests_finished_total{finish_reason="length",replica="1",role="decode"}']
    for part in ("queue", "prefill"):
        assert m[f'meshserve_request_{part}_time_seconds_count{{replica="1",role="decode"}}'] \
            == done == 4
