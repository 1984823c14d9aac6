"""A worker's sampler: each sequence's sampling params and generator, kept across steps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from meshserve.engine.sampling_params import SamplingParams, SequenceSampling
from meshserve.engine.worker.logit_adjuster import LogitAdjuster
from meshserve.engine.worker.sampled_tokens import Logprob, SampledTokens
from meshserve.engine.worker.sampler import Sampler


@dataclass
class StepResult:
    """Tokens sampled in one step, by sequence id."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, Logprob] = field(default_factory=dict)


class StepSampler:
    """Sampling with per-sequence generators and token histories: a seeded request gives
    the same tokens whatever else shares its batch, and across preemptions."""

    def __init__(self, device: torch.device, engine_seed: int, vocab_size: int) -> None:
        self.device, self.engine_seed = device, engine_seed
        self.sampler = Sampler()
        self.adjuster = LogitAdjuster(vocab_size, device)
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator | None] = {}

    def track(self, new_seqs: Mapping[int, SequenceSampling], finished: Sequence[int]) -> None:
        """Start tracking new sequences; forget finished ones."""
        for seq_id in finished:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)
            self.adjuster.forget(seq_id)
        for seq_id, seq in new_seqs.items():
            p = seq.params
            self.params[seq_id] = p
            self.adjuster.track(seq_id, seq)
            gen = None
            if not p.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed if p.seed is not None
                                else hash((self.engine_seed, seq_id)) & (2**63 - 1))
            self.generators[seq_id] = gen

    def sample(self, logits: torch.Tensor, seq_ids: list[int]) -> StepResult:
        """One token per row of `logits` [N, V], row i belonging to seq_ids[i]."""
        return step_result(self.launch(logits, seq_ids))

    def launch(self, logits: torch.Tensor, seq_ids: list[int]) -> SampledTokens:
        """Sample on the device; the host reads the tokens when it waits for them."""
        if not seq_ids:
            return SampledTokens([], torch.empty(0, dtype=torch.long))
        params = [self.params[i] for i in seq_ids]
        logits = logits.float()
        adjusted = self.adjuster.apply(logits, seq_ids, params)
        tokens = self.sampler.sample_tokens(adjusted, params,
                                            [self.generators[i] for i in seq_ids])
        self.adjuster.record(seq_ids, params, tokens)
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
