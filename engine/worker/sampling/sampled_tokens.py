"""One step's sampled tokens: on the device at once, on the host when someone waits.

Async scheduling launches step n+1 before the host has read step n's tokens: step n+1
feeds them from the device (`feed_placeholders`) while they travel to the host through a
pinned buffer, and only `SampledTokens.wait` blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from meshserve.engine.core.scheduler_output import PLACEHOLDER_TOKEN
from meshserve.engine.worker.step_inputs import ScheduledLike, to_device

Logprob = tuple[float, list[tuple[int, float]]]


class PromptScores(Protocol):
    """A step's prompt log-probs (PromptLogprobs), read when the step's tokens are."""

    def wait(self) -> dict[int, tuple[int, list[Logprob]]]: ...


class SampledTokens:
    """Tokens [N] sampled on the device for `seq_ids`, copied to the host without a sync."""

    def __init__(self, seq_ids: list[int], tokens: torch.Tensor,
                 logprobs: Callable[[list[int]], list[Logprob | None]] | None = None,
                 accepted: dict[int, list[int]] | None = None,
                 num_drafted: dict[int, int] | None = None,
                 prompt: PromptScores | None = None) -> None:
        self.seq_ids = seq_ids
        self.tokens = tokens
        """[N] long on the device (row i is seq_ids[i]'s)."""
        self.accepted = accepted or {}
        """Speculating sequences: the drafts accepted, which come before their token."""
        self.num_drafted = num_drafted or {}
        """... and how many drafts each one verified (a draft model may stop short of the
        slots the scheduler reserved)."""
        self.prompt = prompt
        """The step's prompt log-probs, where a chunk scores its prompt."""
        self._logprobs = logprobs
        self._rows: dict[int, int] | None = None
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if tokens.device.type == "cuda" and seq_ids:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def row(self, seq_id: int) -> int:
        """The row of `seq_id`'s token."""
        if self._rows is None:
            self._rows = {s: i for i, s in enumerate(self.seq_ids)}
        return self._rows[seq_id]

    def wait(self) -> tuple[list[int], list[Logprob | None]]:
        """The tokens on the host (blocks until the device has sampled them), and each
        row's logprobs (None where not asked for)."""
        if self._event is not None:
            assert self._host is not None
            self._event.synchronize()
            tokens = self._host.tolist()
        else:
            tokens = self.tokens.tolist()
        logprobs: list[Logprob | None] = (self._logprobs(tokens) if self._logprobs is not None
                                          else [None] * len(tokens))
        return tokens, logprobs


def feed_placeholders(input_ids: torch.Tensor, rows: Sequence[ScheduledLike],
                      previous: SampledTokens | None) -> None:
    """For each rows[i] whose token is PLACEHOLDER_TOKEN (a one-token decode; row i of
    `input_ids`), input_ids[i] = the token `previous` sampled for it, on the device.

    The steady decode state (the same sequences in the same order, every row a
    placeholder) is one device-to-device copy; anything else one indexed copy."""
    held = [i for i, s in enumerate(rows) if s.token_ids[0] == PLACEHOLDER_TOKEN]
    if not held:
        return
    seq_ids = [rows[i].seq_id for i in held]
    if previous is None:
        raise ValueError(f"placeholder tokens for sequences {seq_ids[:4]} but no "
                         "previous step sampled them")
    src = [previous.row(s) for s in seq_ids]
    n = len(held)
    if _is_range(held) and _is_range(src):
        input_ids[held[0]:held[0] + n].copy_(previous.tokens[src[0]:src[0] + n],
                                             non_blocking=True)
        return
    dev = input_ids.device
    input_ids.index_copy_(0, to_device(held, dev),
                          previous.tokens.index_select(0, to_device(src, dev)))


def _is_range(xs: Sequence[int]) -> bool:
    return all(b == a + 1 for a, b in zip(xs, xs[1:]))
