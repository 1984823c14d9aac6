"""Online benchmark: replay a workload against a running server over HTTP.

Each request is sent at its arrival time (Poisson arrivals at a rate) as a streaming
/v1/completions call, greedy and made to generate exactly its max_new_tokens: with its
prompt token ids and ignore_eos (meshserve), or as text in another server's dialect
(`request_body`). TTFT is measured from the send to the first chunk carrying a
token, TPOT from there to the last. A sweep runs the same requests at several rates.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from meshserve.bench.metrics import RequestRecord, RunResult, summarize
from meshserve.bench.workloads import BenchRequest


@dataclass(frozen=True)
class ServerInfo:
    """What /v1/models says about the served model."""

    url: str
    model: str
    max_model_len: int | None


@dataclass
class OnlineRun:
    """One rate's replay: completed requests and the ones that failed (with why)."""

    rate: float | None
    run: RunResult
    failures: list[str] = field(default_factory=list)


def headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header for `api_key` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_info(url: str, api_key: str | None, timeout_s: float = 30.0) -> ServerInfo:
    """The first served model; ValueError naming bench.url when the server cannot be asked."""
    try:
        resp = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers(api_key),
                         timeout=timeout_s)
        resp.raise_for_status()
        model = resp.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise ValueError(f"bench.url={url!r}: GET /v1/models failed ({e}); allowed is the "
                         "base URL of a running `meshserve serve`") from None
    return ServerInfo(url.rstrip("/"), model["id"], model.get("max_model_len"))


Decode = Callable[[list[int]], str]
"""Token ids -> text, for the text APIs."""


def request_body(api: str, info: ServerInfo, req: BenchRequest,
                 decode: Decode | None) -> dict[str, Any]:
    """The streaming /v1/completions body of `req` in `api`'s dialect (BenchConfig.api):
    greedy, and made to generate exactly max_new_tokens."""
    n = req.max_new_tokens
    if api == "token-ids":
        return {"model": info.model, "prompt": req.prompt_token_ids, "max_tokens": n,
                "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}
    if decode is None:
        raise ValueError(f"bench.api={api!r} sends text: it needs the model's tokenizer")
    body: dict[str, Any] = {"model": info.model, "prompt": decode(req.prompt_token_ids),
                            "max_tokens": n, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if api == "text":
        return {**body, "ignore_eos": True}
    if api == "transformers":  # no ignore_eos there: a minimum length in its own config
        gen = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False}
        return {**body, "generation_config": json.dumps(gen)}
    raise ValueError(f"bench.api={api!r} is invalid: allowed are token-ids, text, transformers")


async def _one(client: httpx.AsyncClient, info: ServerInfo, req: BenchRequest, t0: float,
               api: str = "token-ids", decode: Decode | None = None) -> RequestRecord | str:
    """Send `req` at its arrival time; its record, or an error message.

    Generated tokens are the streamed token ids where the server sends them, else the
    final usage chunk's completion_tokens; the first token is the first chunk with any."""
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.monotonic()))
    body = request_body(api, info, req, decode)
    sent = time.monotonic()
    first: float | None = None
    tokens: list[int] = []
    counted: int | None = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                return f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]
                    return f"stream error: {err.get('message') if isinstance(err, dict) else err}"
                choices = chunk.get("choices") or []
                new = [t for c in choices for t in c.get("token_ids") or []]
                text = any(c.get("text") for c in choices)
                if (new or text) and first is None:
                    first = time.monotonic()
                tokens += new
                if chunk.get("usage"):
                    counted = chunk["usage"].get("completion_tokens")
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    generated = len(tokens) if tokens or counted is None else counted
    return RequestRecord(arrival=sent - t0, first_token=None if first is None else first - t0,
                         finish=time.monotonic() - t0,
                         num_prompt_tokens=len(req.prompt_token_ids),
                         num_generated_tokens=generated, token_ids=tokens)


async def replay(info: ServerInfo, reqs: list[BenchRequest], *, rate: float | None,
                 api_key: str | None = None, timeout_s: float = 600.0,
                 api: str = "token-ids", decode: Decode | None = None) -> OnlineRun:
    """Send every request at its arrival time, all concurrently; wait for all."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=info.url, headers=headers(api_key), limits=limits,
                                 timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
        t0 = time.monotonic()
        results = await asyncio.gather(*(_one(client, info, r, t0, api, decode)
                                         for r in reqs))
    records = [r for r in results if isinstance(r, RequestRecord)]
    failures = [r for r in results if isinstance(r, str)]
    wall = (max(r.finish for r in records) - min(r.arrival for r in records)) if records \
        else 0.0
    return OnlineRun(rate, RunResult(f"http:{info.model}", records, wall), failures)


def reset_prefix_cache(info: ServerInfo, api_key: str | None) -> bool:
    """Ask the server to empty its prefix cache (each rate starts cold, as offline runs do);
    False when it cannot (not meshserve, or an older one)."""
    try:
        resp = httpx.post(f"{info.url}/reset_prefix_cache", headers=headers(api_key),
                          timeout=30.0)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200


def summarize_online(run: OnlineRun, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
    """summarize()'s metrics of the completed requests, plus the rate and the failures."""
    base: dict[str, Any] = summarize(run.run, slo_ttft_s, slo_tpot_s) if run.run.records \
        else {"num_requests": 0}
    return {"rate_req_s": run.rate, **base, "num_failed": len(run.failures),
            "failures": run.failures[:10]}


def sweep(info: ServerInfo, reqs_at: Callable[[float | None], list[BenchRequest]],
          rates: list[float | None], *, api_key: str | None, timeout_s: float,
          slo: tuple[float, float],
          on_done: Callable[[dict[str, Any]], None] | None = None, api: str = "token-ids",
          decode: Decode | None = None) -> list[dict[str, Any]]:
    """Replay `reqs_at(rate)` at each rate in turn, each after emptying the server's
    prefix cache; one summary per rate."""
    out = []
    for rate in rates:
        cold = reset_prefix_cache(info, api_key)
        run = asyncio.run(replay(info, reqs_at(rate), rate=rate, api_key=api_key,
                                 timeout_s=timeout_s, api=api, decode=decode))
        summary = {**summarize_online(run, *slo), "prefix_cache_reset": cold}
        out.append(summary)
        if on_done is not None:
            on_done(summary)
    return out
