"""Prompt log-probs: each prompt token's log-probability under the logits of the position
before it, and the top k there, from the prefill pass's own logits (no second forward).

The rows that score a prompt chunk are gathered after the sampled rows, so the LM head runs
once over both; here they are split off and reduced on the device (log-softmax, the target
token's value, top k) a slice of rows at a time, so a long chunk never holds more than one
slice's float32 log-probs. The host reads the result when the step's tokens are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from meshserve.engine.worker.sampling.sampled_tokens import Logprob
from meshserve.engine.worker.step_inputs import PromptRows

SLICE_ROWS = 256
"""Rows reduced at a time: [SLICE_ROWS, vocab] float32 at most lives at once."""

PromptChunk = tuple[int, list[Logprob]]
"""A scored chunk: the position of its first scored token, and per token its log-prob and
the top k (token id, log-prob) at its position."""


@dataclass(frozen=True, slots=True)
class PromptLogits:
    """The logits of a step's scoring rows [rows.num_rows, vocab]."""

    rows: PromptRows
    logits: torch.Tensor


@dataclass(frozen=True, slots=True)
class StepLogits:
    """What the LM head gave a step: the sampled rows' logits (None on a rank without the
    head) and their sequences, and the scoring rows' logits where a chunk asked."""

    logits: torch.Tensor | None
    seq_ids: list[int]
    prompt: PromptLogits | None = None


def split_logits(logits: torch.Tensor | None, seq_ids: list[int],
                 prompt: PromptRows | None) -> StepLogits:
    """Split the LM head's output over a step's logit rows (StepInputs.logit_rows): the
    rows of `seq_ids` that sample, then the `prompt` rows that score."""
    if prompt is None or logits is None:
        return StepLogits(logits, seq_ids)
    n = len(seq_ids)
    return StepLogits(logits[:n], seq_ids, PromptLogits(prompt, logits[n:]))


class PromptLogprobs:
    """A step's prompt log-probs, reduced on the device at construction, read by `wait`."""

    def __init__(self, prompt: PromptLogits, tops: Sequence[int]) -> None:
        """`tops`: for each chunk of `prompt.rows`, how many top tokens it asks for."""
        rows, logits = prompt.rows, prompt.logits
        assert logits.shape[0] == rows.num_rows, (logits.shape, rows.num_rows)
        self.rows, self.tops = rows, list(tops)
        k = max(self.tops, default=0)
        targets = torch.tensor([t for ts in rows.targets for t in ts], device=logits.device)
        values, top_v, top_i = [], [], []
        for a in range(0, rows.num_rows, SLICE_ROWS):
            lp = logits[a:a + SLICE_ROWS].float().log_softmax(dim=-1)
            values.append(lp.gather(1, targets[a:a + SLICE_ROWS, None]).squeeze(1))
            if k:
                v, i = lp.topk(k, dim=-1)
                top_v.append(v)
                top_i.append(i)
        self._values = torch.cat(values)
        self._top = (torch.cat(top_v), torch.cat(top_i)) if k else None

    def wait(self) -> dict[int, PromptChunk]:
        """Per sequence its chunk's first scored position and entries (blocks until the
        device has computed them)."""
        values = self._values.tolist()
        top_v, top_i = ((self._top[0].tolist(), self._top[1].tolist()) if self._top is not None
                        else ([], []))
        out: dict[int, PromptChunk] = {}
        at = 0
        for seq_id, start, targets, k in zip(self.rows.seq_ids, self.rows.starts,
                                             self.rows.targets, self.tops):
            entries: list[Logprob] = []
            for j in range(at, at + len(targets)):
                entries.append((values[j], list(zip(top_i[j][:k], top_v[j][:k])) if k else []))
            out[seq_id] = (start, entries)
            at += len(targets)
        return out
