"""A server that speculates: streams carry several tokens per step and equal the whole
text, usage counts are unchanged, and the drafts show in /metrics."""

from __future__ import annotations

import openai
import pytest

from .conftest import ENGINE_OVERRIDES

REPEATS = "import os\nimport sys\nimport os\nimport sys\nimport"


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_streams_usage_and_metrics_under_speculation(start_server, server, method: str) -> None:
    srv = start_server([*ENGINE_OVERRIDES, f"speculative={method}",
                        "speculative.max_batch_size=8"])
    spec = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
    plain = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    kw = dict(model="meshcoder", prompt=REPEATS, max_tokens=40, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    want = plain.completions.create(**kw)
    whole = spec.completions.create(**kw)
    assert whole.choices[0].text == want.choices[0].text
    assert whole.usage.completion_tokens == want.usage.completion_tokens == 40
    chunks = list(spec.completions.create(**kw, stream=True,
                                          stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert text == want.choices[0].text and ids == want.choices[0].token_ids
    assert max(len(c.choices[0].token_ids) for c in chunks if c.choices) > 1  # several a step
    assert chunks[-1].usage.completion_tokens == 40
    m = srv.wait_idle()
    assert m["meshserve_spec_decode_num_accepted_tokens_total"] > 0
    assert m["meshserve_spec_decode_num_draft_tokens_total"] >= \
        m["meshserve_spec_decode_num_accepted_tokens_total"]
    assert m['meshserve_spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    assert m["meshserve_kv_blocks_used"] == 0
