"""Many concurrent streams and clients that leave: nothing lost, duplicated or leaked."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

NUM_CLIENTS = 200
MAX_TOKENS = 6


async def stream_one(client: httpx.AsyncClient, i: int) -> dict:
    """One streaming completion; what came back, or the error it got."""
    body = {"model": "meshcoder", "prompt": f"# request {i}\ndef f_{i}(x):",
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True,
            "return_token_ids": True}
    result: dict = {"i": i, "ids": set(), "indices": [], "tokens": [], "finish": None,
                    "done": False, "error": None}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result["error"] = (resp.status_code, (await resp.aread()).decode())
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    result["done"] = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    result["error"] = chunk["error"]
                    continue
                result["ids"].add(chunk["id"])
                for c in chunk["choices"]:
                    result["indices"].append(c["index"])
                    result["tokens"] += c["token_ids"]
                    result["finish"] = c["finish_reason"] or result["finish"]
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    return result


async def many_streams(url: str) -> list[dict]:
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:
        return await asyncio.gather(*(stream_one(client, i) for i in range(NUM_CLIENTS)))


@pytest.mark.slow
def test_concurrent_streams_all_complete_and_free_every_block(server) -> None:
    before = server.metrics()
    t0 = time.monotonic()
    results = asyncio.run(many_streams(server.url))
    wall = time.monotonic() - t0
    errors = [r for r in results if r["error"] is not None]
    assert not errors, errors[:3]  # this bounded load fits: nothing should be refused
    assert all(r["done"] for r in results)
    assert all(len(r["tokens"]) == MAX_TOKENS and r["finish"] == "length" for r in results)
    assert all(set(r["indices"]) == {0} for r in results)
    ids = [next(iter(r["ids"])) for r in results]
    assert all(len(r["ids"]) == 1 for r in results) and len(set(ids)) == NUM_CLIENTS
    after = server.wait_idle()
    assert after["meshserve_kv_blocks_used"] == 0
    assert after["meshserve_kv_blocks_free"] == after["meshserve_kv_blocks_total"]
    assert after["meshserve_open_streams"] == 0
    finished = 'meshserve_requests_finished_total{finish_reason="length"}'
    assert after[finished] - before.get(finished, 0) == NUM_CLIENTS
    gen = after["meshserve_generation_tokens_total"] - before["meshserve_generation_tokens_total"]
    assert gen == NUM_CLIENTS * MAX_TOKENS
    print(f"{NUM_CLIENTS} streams x {MAX_TOKENS} tokens in {wall:.2f} s")


async def leave_mid_stream(url: str, n: int) -> int:
    """Start `n` long streams, read each one's first token, then drop the connections."""
    body = {"model": "meshcoder", "prompt": "class Tree:", "max_tokens": 200,
            "temperature": 0.8, "stream": True, "ignore_eos": True}
    got_first = 0
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        async def one(seed: int) -> None:
            nonlocal got_first
            async with client.stream("POST", "/v1/completions", json={**body, "seed": seed}
                                     ) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        got_first += 1
                        return  # leaving the block closes the connection mid-stream

        await asyncio.gather(*(one(s) for s in range(n)))
    return got_first


@pytest.mark.slow
def test_clients_leaving_mid_stream_free_their_blocks(server) -> None:
    before = server.metrics()
    assert asyncio.run(leave_mid_stream(server.url, 8)) == 8
    after = server.wait_idle(timeout_s=20.0)
    assert after["meshserve_kv_blocks_used"] == 0, after
    assert after["meshserve_kv_blocks_free"] == after["meshserve_kv_blocks_total"]
    assert after["meshserve_requests_aborted_total"] - before["meshserve_requests_aborted_total"] \
        == 8
    # A non-streaming client that gives up (timeout) is aborted too. The request runs to
    # the context limit (about 0.6 s on one core), four times the client's patience.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.15,
                   json={"prompt": "x", "max_tokens": 250, "ignore_eos": True})
    after = server.wait_idle(timeout_s=20.0)
    assert after["meshserve_kv_blocks_used"] == 0, after
    assert after["meshserve_requests_aborted_total"] - before["meshserve_requests_aborted_total"] \
        == 9
