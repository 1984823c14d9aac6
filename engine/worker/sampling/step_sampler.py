"""A worker's sampler: each sequence's sampling params and generator, kept across steps."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from meshserve.engine.core.sampling_params import SamplingParams, SequenceSampling
from meshserve.engine.worker.sampling.grammar import Grammars, apply_bitmask
from meshserve.engine.worker.sampling.logit_adjuster import LogitAdjuster
from meshserve.engine.worker.sampling.prompt_logprobs import (
    PromptChunk,
    PromptLogits,
    PromptLogprobs,
)
from meshserve.engine.worker.sampling.rejection_sampler import verify, verify_greedy_lists
from meshserve.engine.worker.sampling.sampled_tokens import Logprob, SampledTokens
from meshserve.engine.worker.sampling.sampler import Sampler
from meshserve.kernels import dispatch


@dataclass
class StepResult:
    """Tokens sampled in one step, by sequence id."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, Logprob] = field(default_factory=dict)
    accepted: dict[int, list[int]] = field(default_factory=dict)
    """Speculating sequences: their accepted drafts, emitted before tokens[seq_id]."""
    num_drafted: dict[int, int] = field(default_factory=dict)
    """... and the drafts each verified."""
    prompt_logprobs: dict[int, PromptChunk] = field(default_factory=dict)
    """Scored prompt chunks of the step (prompt log-probs), by sequence."""


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

    def sample(self, logits: torch.Tensor, seq_ids: list[int],
               drafts: Mapping[int, list[int]] | None = None,
               draft_probs: Mapping[int, torch.Tensor] | None = None,
               prompt: PromptLogits | None = None) -> StepResult:
        """One token per row of `logits` [N, V], row i belonging to seq_ids[i]; with
        `drafts`, a speculating sequence's rows (one per draft and one more) verify them
        (`draft_probs`: as launch() takes them); `prompt`: the rows scoring prompt tokens."""
        result = step_result(self.launch(logits, seq_ids, drafts, draft_probs, prompt))
        self._accept_sampled()
        return result

    def _accept_sampled(self) -> None:
        """Advance each constrained sequence's grammar by its sampled tokens."""
        pending, self._unaccepted = self._unaccepted, []
        for ids, tokens in pending:
            self.grammars.accept(ids, tokens.tolist())

    def launch(self, logits: torch.Tensor, seq_ids: list[int],
               drafts: Mapping[int, list[int]] | None = None,
               draft_probs: Mapping[int, torch.Tensor] | None = None,
               prompt: PromptLogits | None = None) -> SampledTokens:
        """Sample on the device; the host reads the tokens when it waits for them.
        `draft_probs`: a draft model's distributions [n, V] for its n drafts of a sampled
        request (n-gram drafts have none: point masses). `prompt`: the rows scoring prompt
        tokens, reduced to their log-probs here from the raw logits."""
        sampled = self._launch(logits, seq_ids, drafts, draft_probs)
        if prompt is not None:
            sampled.prompt = PromptLogprobs(
                prompt, [self.params[i].prompt_logprobs or 0 for i in prompt.rows.seq_ids])
        return sampled

    def _launch(self, logits: torch.Tensor, seq_ids: list[int],
                drafts: Mapping[int, list[int]] | None,
                draft_probs: Mapping[int, torch.Tensor] | None) -> SampledTokens:
        if not seq_ids:
            return SampledTokens([], torch.empty(0, dtype=torch.long))
        if drafts:
            return self._verify(logits.float(), seq_ids, drafts, draft_probs or {})
        params = [self.params[i] for i in seq_ids]
        logits = logits.float()
        adjusted = self.adjuster.apply(logits, seq_ids, params)
        rows = ([i for i, p in enumerate(params) if p.structured_outputs is not None]
                if self._grammars is not None and self._grammars.matchers else [])
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

    def _verify(self, logits: torch.Tensor, seq_ids: list[int],
                drafts: Mapping[int, list[int]],
                draft_probs: Mapping[int, torch.Tensor]) -> SampledTokens:
        """A step with drafts: plain rows sample as usual, each speculating sequence's
        rows verify its drafts (rejection sampling against its processed distribution)."""
        order: list[int] = []
        rows: dict[int, list[int]] = {}
        for r, s in enumerate(seq_ids):
            if s not in rows:
                order.append(s)
                rows[s] = []
            rows[s].append(r)
        spec = [s for s in order if drafts.get(s)]
        plain = [s for s in order if not drafts.get(s)]
        final: dict[int, int] = {}
        plain_logprobs: dict[int, Logprob | None] = {}
        if plain:
            idx = torch.tensor([rows[s][0] for s in plain], device=logits.device)
            tokens, logprobs = self.launch(logits.index_select(0, idx), plain).wait()
            final.update(zip(plain, tokens))
            plain_logprobs.update(zip(plain, logprobs))
        params = [self.params[s] for s in spec]
        if all(p.greedy for p in params):  # the argmax of each row is all it takes
            idx = torch.tensor([r for s in spec for r in rows[s]], device=logits.device)
            best = dispatch.argmax_rows(logits.index_select(0, idx)).tolist()
            per_seq, at = [], 0
            for s in spec:
                per_seq.append(best[at:at + len(rows[s])])
                at += len(rows[s])
            out = verify_greedy_lists(per_seq, [drafts[s] for s in spec])
        else:
            k, vocab = max(len(drafts[s]) for s in spec), logits.shape[-1]
            gathered = logits.new_full((len(spec), k + 1, vocab), float("-inf"))
            for i, s in enumerate(spec):
                gathered[i, :len(rows[s])] = logits[rows[s][0]:rows[s][-1] + 1]
            flat = gathered.view(-1, vocab)
            row_params = [p for p in params for _ in range(k + 1)]
            probs = self.sampler.probs(flat, row_params).view(len(spec), k + 1, vocab)
            q = None
            if draft_probs:  # a draft model's; a greedy row's stays unread (ones)
                q = probs.new_ones(len(spec), k, vocab)
                for i, s in enumerate(spec):
                    if s in draft_probs:
                        q[i, :len(drafts[s])] = draft_probs[s]
            out = verify(probs, [drafts[s] for s in spec], q, [p.greedy for p in params],
                         [self.generators[s] for s in spec], target_argmax=gathered.argmax(-1))
        accepted = {}
        for s, toks in zip(spec, out.tokens):
            accepted[s] = toks[:-1]
            final[s] = toks[-1]

        def plain_rows_logprobs(_: list[int]) -> list[Logprob | None]:  # (only plain rows
            return [plain_logprobs.get(s) for s in order]  # ask for them)

        return SampledTokens(order, torch.tensor([final[s] for s in order]),
                             plain_rows_logprobs if any(plain_logprobs.values()) else None,
                             accepted,
                             {s: len(drafts[s]) for s in spec})


def step_result(sampled: SampledTokens) -> StepResult:
    """Wait for `sampled` and key its tokens and logprobs by sequence."""
    tokens, logprobs = sampled.wait()
    ids = sampled.seq_ids
    return StepResult(dict(zip(ids, tokens)),
                      {i: lp for i, lp in zip(ids, logprobs) if lp is not None},
                      dict(sampled.accepted), dict(sampled.num_drafted),
                      sampled.prompt.wait() if sampled.prompt is not None else {})
