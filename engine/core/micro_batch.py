"""Sizing micro-batches for a pipeline: each gets an even share of the tokens to run."""

from __future__ import annotations

MIN_CPU_MICRO_BATCH_TOKENS = 256
"""The smallest automatic CPU micro-batch: below it prefill GEMMs lose efficiency."""


def micro_batch_cap(max_num_batched_tokens: int, num_slots: int, device_type: str,
                    configured: int | None = None) -> int:
    """Most tokens one micro-batch of a pipeline carries: `configured`
    (parallel.micro_batch_tokens) if set, else the step budget on GPUs and on CPUs the step
    budget over twice the slots, at least MIN_CPU_MICRO_BATCH_TOKENS.

    A pipeline idles for about one micro-batch's stage time where it fills (the first
    prefill), where prefill gives way to decode (the decodes wait for the last prompt
    chunks) and where it drains. On a CPU a 2,048-token prefill micro-batch takes seconds a
    stage while 512 tokens still keep its GEMMs efficient, so smaller micro-batches shrink
    those idle stretches (figures: docs/benchmarks/2026-11-30-cpu-2core.md, pipelines)."""
    if configured is not None:
        return max(1, min(configured, max_num_batched_tokens))
    if device_type != "cpu" or num_slots <= 1:
        return max_num_batched_tokens
    share = max_num_batched_tokens // (2 * num_slots)
    return min(max_num_batched_tokens, max(MIN_CPU_MICRO_BATCH_TOKENS, share))


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
