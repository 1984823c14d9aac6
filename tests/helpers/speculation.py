"""What the speculative-decoding tests share: prompts of code that repeats itself (prompt
lookup finds drafts the bundled model accepts; the bundled draft agrees on much of it),
the scheduling modes they run under and greedy params."""

from __future__ import annotations

from meshserve import LLM, SamplingParams
from meshserve.engine.engine import Engine

FP32 = "model.dtype=float32"
"""Token identity across batch shapes holds in fp32 (bf16 batches round in oneDNN)."""
ONE_RANK = ["parallel=single", "threads=1", FP32]
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "import os\nimport sys\nimport re\nimport os\nimport sys\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in",
    "x = 1\n",
    "class A:\n    def __init__(self):\n        self.x = 1\n\nclass B:\n    def __init__(self):",
]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
MODES = {
    "continuous": [],
    "chunk-7": ["engine.max_num_batched_tokens=7"],
    "preempt": ["engine.block_size=4", "engine.num_gpu_blocks=40"],
    "static": ["engine=static", "engine.static_batch_size=2"],
    "no-prefix-cache": ["engine.enable_prefix_caching=false"],
}
"""Scheduling modes: continuous batching, chunked prefill, forced preemption, static
batches, no prefix cache."""


def check_prefix_hits_under_tensor_parallel(spec: list[str], plain: list[list[int]]) -> None:
    """TP=2 with small blocks, the prompts twice: both passes equal plain decoding, the
    second hits the prefix cache, and drafts were accepted."""
    llm = LLM("meshcoder", overrides=[*spec, FP32, "parallel.tp=2", "engine.block_size=4"],
              progress=False)
    try:
        first = llm.generate(PROMPTS, GREEDY)
        again = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in first] == [o.token_ids for o in again] == plain
        assert sum(o.metrics.num_cached_tokens for o in again) > 0
        assert llm.engine.stats.spec.num_accepted_tokens > 0
    finally:
        llm.shutdown()


def plain_outputs(params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    """PROMPTS decoded without speculation on one rank: what every speculating run gives."""
    llm = LLM("meshcoder", overrides=ONE_RANK, progress=False)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()


def check_counts(llm: LLM, outs: list) -> None:
    """Every KV block back, drafts accepted (not only made), and the requests' draft and
    accepted counts adding up to the run's."""
    stats = llm.engine.stats
    assert stats.num_free_blocks == llm.engine.num_blocks
    assert stats.spec.num_accepted_tokens > 0
    assert sum(o.metrics.num_accepted_tokens for o in outs) == stats.spec.num_accepted_tokens
    assert sum(o.metrics.num_draft_tokens for o in outs) == stats.spec.num_draft_tokens


def check_aborts_give_every_block_back(engine: Engine, request_ids: list[str]) -> None:
    """Abort `request_ids`, run the rest to the end: every KV block is free again."""
    for rid in request_ids:
        assert engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.num_free_blocks == engine.num_blocks
