"""A worker's sampler: each sequence's sampling params and generator, kept across steps."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from meshserve.engine.sampling_params import SamplingParams, SequenceSampling
from meshserve.engine.worker.grammar import Grammars, apply_bitmask
from meshserve.engine.worker.logit_adjuster import LogitAdjuster
from meshserve.engine.worker.sampled_tokens import Logprob, SampledTokens
from meshserve.engine.worker.sampler import Sampler


@dataclass
class StepResult:
    """Tokens sampled in one step, by sequence id."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, Logprob] = field(default_factory=dict)


class StepSampler:
    """Sampling with per-sequence generators, token histories and grammars: a seeded
    request gives the same tokens whatever else shares its batch, and across preemptions.

    A constrained sequence's grammar advances by the tokens sampled for it; the next step
    that constrains it first reads them (a wait on the device only for such steps)."""

    def __init__(self, device: torch.device, engine_seed: int, vocab_size: int,
                 grammars: Callable[[], Grammars] | None = None) -> None:
        """`grammars`: builds the grammar state at the first constrained sequence."""
        self.device, self.engine_seed = device, engine_seed
        self.sampler = Sampler()
        self.adjuster = LogitAdjuster(vocab_size, device)
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator | None] = {}
        self._make_grammars = grammars
        self._grammars: Grammars | None = None
        self._unaccepted: list[tuple[list[int], torch.Tensor]] = []
        """(constrained seq ids, their sampled tokens on the device) not yet accepted."""

    @property
    def grammars(self) -> Grammars:
        if self._grammars is None:
            if self._make_grammars is None:
                raise ValueError("structured_outputs: this sampler was built without grammars")
            self._grammars = self._make_grammars()
        return self._grammars

    def track(self, new_seqs: Mapping[int, SequenceSampling], finished: Sequence[int]) -> None:
        """Start tracking new sequences; forget finished ones."""
        for seq_id in finished:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)
            self.adjuster.forget(seq_id)
            if self._grammars is not None:
                self._grammars.forget(seq_id)
        for seq_id, seq in new_seqs.items():
            p = seq.params
            self.params[seq_id] = p
            self.adjuster.track(seq_id, seq)
            if p.structured_outputs is not None:
                self.grammars.track(seq_id, p.structured_outputs)
            gen = None
            if not p.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed if p.seed is not None
                                else hash((self.engine_seed, seq_id)) & (2**63 - 1))
            self.generators[seq_id] = gen

    def sample(self, logits: torch.Tensor, seq_ids: list[int]) -> StepResult:
        """One token per row of `logits` [N, V], row i belonging to seq_ids[i]."""
        result = step_result(self.launch(logits, seq_ids))
        self._accept_sampled()
        return result

    def _accept_sampled(self) -> None:
        """Advance each constrained sequence's grammar by its sampled tokens."""
        pending, self._unaccepted = self._unaccepted, []
        for ids, tokens in pending:
            self.grammars.accept(ids, tokens.tolist())

    def launch(self, logits: torch.Tensor, seq_ids: list[int]) -> SampledTokens:
        """Sample on the device; the host reads the tokens when it waits for them."""
        if not seq_ids:
            return SampledTokens([], torch.empty(0, dtype=torch.long))
        params = [self.params[i] for i in seq_ids]
        logits = logits.float()
        adjusted = self.adjuster.apply(logits, seq_ids, params)
        rows = [i for i, p in enumerate(params) if p.structured_outputs is not None]
        if rows:
            self._accept_sampled()
            constrained = [seq_ids[i] for i in rows]
            if adjusted is logits:  # the raw logits stay as they are, for logprobs
                adjusted = logits.clone()
            apply_bitmask(adjusted, rows, self.grammars.bitmask(constrained))
        tokens = self.sampler.sample_tokens(adjusted, params,
                                            [self.generators[i] for i in seq_ids])
        self.adjuster.record(seq_ids, params, tokens)
        if rows:
            self._unaccepted.append((constrained, tokens.index_select(
                0, torch.tensor(rows, device=tokens.device))))
        logprobs = None
        if any(p.logprobs is not None for p in params):
            def logprobs(token_ids: list[int]) -> list[Logprob | None]:
                return self.sampler.logprobs(logits, params, token_ids)
        return SampledTokens(seq_ids, tokens, logprobs)


def step_result(sampled: SampledTokens) -> StepResult:
    """Wait for `sampled` and key its tokens and logprobs by sequence."""
    tokens, logprobs = sampled.wait()
    ids = sampled.seq_ids
    return StepResult(dict(zip(ids, tokens)),
                      {i: lp for i, lp in zip(ids, logprobs) if lp is not None})
