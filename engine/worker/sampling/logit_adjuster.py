"""Per-sequence logit adjustments in the batched sampler, on the device: `logit_bias`, and
presence, frequency and repetition penalties.

Semantics as vLLM and OpenAI define them, in vLLM's order: the bias is added first, then
for each token t with c(t) occurrences in the output so far

    repetition (t in the prompt or the output): l / r if l > 0 else l * r
    frequency and presence:                     l - f * c(t) - p * [c(t) > 0]

Only the rows of sequences that ask pay anything. Each penalized sequence holds one row of
a device slab: its output-token counts (updated from the sampled tokens on the device, so
async scheduling never waits for them) and its prompt's token mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshserve.engine.core.sampling_params import SamplingParams, SequenceSampling
from meshserve.engine.worker.step_inputs import to_device


class TokenHistory:
    """Output-token counts and prompt-token masks of penalized sequences, one slab row
    each; the slab doubles when it runs out of rows."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.slots: dict[int, int] = {}
        self._free: list[int] = []
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def add(self, seq_id: int, prompt_token_ids: Sequence[int]) -> None:
        """Give `seq_id` a zeroed row, its prompt's tokens marked."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self.slots[seq_id] = slot
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        if prompt_token_ids:
            self.in_prompt[slot, to_device(list(prompt_token_ids), self.device)] = True

    def remove(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))


class LogitAdjuster:
    """Applies each row's bias and penalties before sampling, and counts what was sampled."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.history = TokenHistory(vocab_size, device)
        self._adjusted: set[int] = set()
        """Tracked sequences with a bias or a penalty: while none is, a step checks nothing."""

    def track(self, seq_id: int, seq: SequenceSampling) -> None:
        p = seq.params
        if p.penalized:
            self.history.add(seq_id, seq.prompt_token_ids)
        if p.penalized or p.logit_bias:
            self._adjusted.add(seq_id)

    def forget(self, seq_id: int) -> None:
        self.history.remove(seq_id)
        self._adjusted.discard(seq_id)

    def apply(self, logits: torch.Tensor, seq_ids: Sequence[int],
              params: Sequence[SamplingParams]) -> torch.Tensor:
        """logits [N, V] (float32) -> adjusted logits; the input is left as it is (its raw
        values give the logprobs), and returned as it is when no row asks."""
        if not self._adjusted:
            return logits
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        penalized = [i for i, p in enumerate(params) if p.penalized]
        if not biased and not penalized:
            return logits
        logits = logits.clone()
        if biased:
            self._add_bias(logits, [params[i] for i in biased], biased)
        if penalized:
            self._penalize(logits, [seq_ids[i] for i in penalized],
                           [params[i] for i in penalized], penalized)
        return logits

    def _add_bias(self, logits: torch.Tensor, params: list[SamplingParams],
                  rows: list[int]) -> None:
        r, t, b = [], [], []
        for row, p in zip(rows, params):
            for token, bias in p.logit_bias_items:
                r.append(row)
                t.append(token)
                b.append(bias)
        index = (to_device(r, self.device), to_device(t, self.device))
        logits.index_put_(index, to_device(b, self.device, torch.float32), accumulate=True)

    def _penalize(self, logits: torch.Tensor, seq_ids: list[int],
                  params: list[SamplingParams], rows: list[int]) -> None:
        h = self.history
        rows_t = to_device(rows, self.device)
        slots = to_device([h.slots[s] for s in seq_ids], self.device)
        counts = h.counts.index_select(0, slots)
        seen_out = counts > 0
        sub = logits.index_select(0, rows_t)

        def column(values: list[float]) -> torch.Tensor:
            return to_device(values, self.device, torch.float32).unsqueeze(1)

        rep = column([p.repetition_penalty for p in params])
        seen = seen_out | h.in_prompt.index_select(0, slots)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - column([p.frequency_penalty for p in params]) * counts \
            - column([p.presence_penalty for p in params]) * seen_out
        logits.index_copy_(0, rows_t, sub)

    def record(self, seq_ids: Sequence[int], params: Sequence[SamplingParams],
               tokens: torch.Tensor) -> None:
        """Count the tokens [N] just sampled for the penalized rows (on the device)."""
        if not self.history.slots:
            return
        rows = [i for i, p in enumerate(params) if p.penalized]
        if not rows:
            return
        h = self.history
        slots = to_device([h.slots[seq_ids[i]] for i in rows], self.device)
        picked = tokens.index_select(0, to_device(rows, self.device))
        h.counts.index_put_((slots, picked), torch.ones_like(picked, dtype=torch.int32),
                            accumulate=True)
