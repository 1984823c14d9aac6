"""Sizing micro-batches for a pipeline: each gets an even share of the tokens to run."""

from __future__ import annotations


def micro_batch_budget(num_pending_tokens: int, num_returning_tokens: int,
                       num_slots: int, max_num_batched_tokens: int) -> int:
    """Token budget of the next micro-batch: the tokens waiting to run now (prefill chunks
    and decodes of sequences not in flight) plus those the micro-batches in flight bring
    back next, spread evenly over the pipeline's `num_slots`, within
    [1, max_num_batched_tokens].

    Counting the returning tokens balances the alternating groups: with 5 decodes ready
    and 1 in flight, the next micro-batch takes 3 and leaves 2 to the one after."""
    assert num_slots >= 1, num_slots
    share = -(-(num_pending_tokens + num_returning_tokens) // num_slots)
    return max(1, min(max_num_batched_tokens, share))
