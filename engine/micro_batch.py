"""Sizing micro-batches for a pipeline: each gets an even share of the pending tokens."""

from __future__ import annotations


def micro_batch_budget(num_pending_tokens: int, num_free_slots: int,
                       max_num_batched_tokens: int) -> int:
    """Token budget of the next micro-batch: the tokens waiting to run (prefill chunks and
    decodes of sequences not in flight) spread evenly over the pipeline's free slots,
    within [1, max_num_batched_tokens]."""
    assert num_free_slots >= 1, num_free_slots
    share = -(-num_pending_tokens // num_free_slots)
    return max(1, min(max_num_batched_tokens, share))
