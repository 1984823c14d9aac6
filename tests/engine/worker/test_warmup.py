"""The start-up warm-up (run on CUDA to compile the kernels) leaves no trace in results."""

from __future__ import annotations

import torch

from meshserve.engine.core.scheduler_output import ScheduledSeq
from meshserve.engine.worker.model_runner import ModelRunner
from meshserve.engine.worker.warmup import warm_up
from meshserve.models.loader import load_model


def _runner(path, num_blocks: int) -> ModelRunner:
    model = load_model(path, progress=False)
    attn = model.attention_layers()[0]
    shape = (num_blocks, 16, attn.num_kv_heads, attn.head_dim)
    cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.attention_layers()]
    return ModelRunner(model, cache, 16, torch.device("cpu"))


def test_warm_up_then_the_same_logits(make_checkpoint) -> None:
    path = make_checkpoint("llama", seed=3)
    warmed, fresh = _runner(path, 4), _runner(path, 4)
    assert warm_up(warmed, 4)
    steps = [[ScheduledSeq(0, list(range(5, 25)), 0, [2, 0], True)],  # reuses warmed blocks
             [ScheduledSeq(0, [7], 20, [2, 0], True)]]
    for step in steps:
        torch.testing.assert_close(warmed.execute(step)[0], fresh.execute(step)[0])


def test_too_few_blocks_skip_it(make_checkpoint) -> None:
    assert not warm_up(_runner(make_checkpoint("llama", seed=3), 2), 2)
