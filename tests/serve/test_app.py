"""In-process checks of the app (API key, schema, metrics) and of AsyncEngine's failure path."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.llm import LLM
from meshserve.serve.app import create_app
from meshserve.serve.async_engine import AsyncEngine, Choice, EngineDeadError, EngineFailure
from meshserve.serve.metrics import ServerMetrics
from meshserve.serve.serve_config import ServeConfig

KEY = "test-key"


async def with_app(offline: LLM, cfg: ServeConfig, api_key: str | None, check) -> None:  # noqa: ANN001
    engine = AsyncEngine(offline.engine, on_outputs=lambda outs: metrics.on_outputs(outs))
    metrics = ServerMetrics(lambda: engine.stats, lambda: engine.replicas,
                            lambda: engine.num_routes)
    app = create_app(engine, metrics, cfg, ["meshcoder"], api_key=api_key)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await check(client)


def test_api_key_schema_and_metrics(offline: LLM) -> None:
    body = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0}

    async def check(client: httpx.AsyncClient) -> None:
        missing = await client.post("/v1/completions", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["param"] == "authorization", missing.text
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await client.post("/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
        assert (await client.get("/health")).json() == {"status": "ok"}
        schema = (await client.get("/openapi.json")).json()
        props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
        assert props["n"]["maximum"] == 3
        assert {"type": "string", "enum": ["meshcoder"]} in props["model"]["anyOf"]
        text = (await client.get("/metrics")).text
        for name in ("meshserve_time_to_first_token_seconds_bucket",
                     "meshserve_time_per_output_token_seconds_count",
                     "meshserve_e2e_request_latency_seconds_sum", "meshserve_kv_blocks_used",
                     "meshserve_request_queue_time_seconds_count",
                     "meshserve_request_prefill_time_seconds_bucket",
                     "meshserve_num_requests_running", "meshserve_num_requests_waiting",
                     "meshserve_prefix_cache_queries_total", "meshserve_prefix_cache_hits_total",
                     "meshserve_num_preemptions_total", "meshserve_generation_tokens_per_second",
                     'meshserve_http_errors_total{status="401"} 2.0'):
            assert name in text, name

    asyncio.run(with_app(offline, ServeConfig(max_n=3), KEY, check))


class _StubEngine:
    """Just enough Engine for AsyncEngine: requests never finish; step() can be made to fail."""

    def __init__(self) -> None:
        self.requests: set[str] = set()
        self.error: Exception | None = None
        self.stats = SimpleNamespace()

    def check_health(self) -> None:
        pass

    def replica_states(self) -> list:
        return []

    def add_request(self, ids: list[int], params: SamplingParams, rid: str,
                    arrival_time: float) -> str:
        if not ids:
            raise ValueError("prompt: empty; allowed is at least one token")
        self.requests.add(rid)
        return rid

    def abort(self, rid: str) -> bool:
        self.requests.discard(rid)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def wake(self) -> None:
        pass

    def step(self) -> list:
        if self.error is not None:
            raise self.error
        return []

    def shutdown(self) -> None:
        pass


def test_a_failing_step_ends_streams_and_refuses_new_work() -> None:
    stub = _StubEngine()
    failures: list[str] = []
    engine = AsyncEngine(stub, max_pending=2, health_interval_s=0.05,  # type: ignore[arg-type]
                         on_failure=failures.append)

    async def run() -> None:
        engine.start(asyncio.get_running_loop())
        params = SamplingParams(max_tokens=4)
        with pytest.raises(ValueError, match="prompt"):
            await engine.add([Choice("a", [1], params), Choice("b", [], params)])
        assert stub.requests == set()  # all or none
        stream = await engine.add([Choice("c", [1], params)])
        assert stub.requests == {"c"}
        stub.error = RuntimeError("rank 3 exited with code 1")
        item = await asyncio.wait_for(stream.get(), 10)
        assert isinstance(item, EngineFailure)
        assert item.message == "engine failed: rank 3 exited with code 1"
        with pytest.raises(EngineDeadError, match="rank 3"):
            await engine.add([Choice("d", [1], params)])

    asyncio.run(run())
    engine.shutdown()  # joins the engine thread
    assert failures == ["engine failed: rank 3 exited with code 1"]
