"""What the speculative-decoding tests share: prompts of code that repeats itself (prompt
lookup finds drafts the bundled model accepts; the bundled draft agrees on much of it),
the scheduling modes they run under and greedy params."""

from __future__ import annotations

from meshserve import SamplingParams

ONE_RANK = ["parallel=single", "threads=1"]
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
