"""A throwaway prefill and decode at start-up, so the first request does not pay for
compiling the kernels (Triton JIT-compiles each kernel at its first launch: on an H200 the
bundled model's first request waited 1.0 s for it)."""

from __future__ import annotations

from meshserve.engine.core.scheduler_output import ScheduledSeq
from meshserve.engine.worker.model_runner import ModelRunner


def warm_up(runner: ModelRunner, num_blocks: int) -> bool:
    """Run a two-sequence prefill (one chunk crossing a block edge) and one decode step on
    blocks 0..2; False (nothing run) with fewer than 3 blocks.

    The blocks are free at start-up: whatever the warm-up writes there is overwritten by
    the sequences that later own them before anything reads it, and no prefix-cache hash
    ever points at it.
    """
    if num_blocks < 3:
        return False
    bs = runner.block_size
    long, short = bs + 1, 3
    prefill = [ScheduledSeq(-1, [1] * long, 0, [0, 1], True),
               ScheduledSeq(-2, [1] * short, 0, [2], True)]
    runner.execute(prefill)
    decode = [ScheduledSeq(-1, [1], long, [0, 1], True),
              ScheduledSeq(-2, [1], short, [2], True)]
    runner.execute(decode)
    return True
