"""What a client sends wrong, answered as OpenAI answers it: an image part to a text
model, several bad fields at once, stream_options without a stream, an unknown model."""

from __future__ import annotations

import asyncio

import httpx

from meshserve.engine.llm import LLM
from meshserve.serve.serve_config import ServeConfig

from .test_app import KEY, with_app

AUTH = {"Authorization": f"Bearer {KEY}"}


def test_openai_shaped_errors(offline: LLM) -> None:
    async def check(client: httpx.AsyncClient) -> None:
        image = {"model": "meshcoder", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
        r = await client.post("/v1/chat/completions", json=image, headers=AUTH)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages", r.text
        assert err["message"].startswith("messages.0.content.1: a image_url part; this "
                                         "model takes text only"), err
        assert err["code"] is None

        both = {"prompt": "x", "temperature": -1, "top_p": 7}
        r = await client.post("/v1/completions", json=both, headers=AUTH)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "temperature", r.text
        assert "temperature:" in err["message"] and "; top_p:" in err["message"], err

        r = await client.post("/v1/completions", headers=AUTH, json={
            "prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"

        r = await client.get("/v1/models/nope", headers=AUTH)
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found", r.text
        r = await client.get("/v1/models/meshcoder", headers=AUTH)
        assert r.status_code == 200 and r.json()["id"] == "meshcoder", r.text

        r = await client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

    asyncio.run(with_app(offline, ServeConfig(), KEY, check))
