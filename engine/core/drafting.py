"""Speculative decoding's side of scheduling: whether a step carries drafts, how many each
sequence proposes, what the draft model feeds before them, and what a verified step keeps.

The scheduler asks this planner at each step; it keeps the run's acceptance counters and
each sequence's pause (a sequence whose drafts keep failing decodes plainly for a while).
"""

from __future__ import annotations

from collections.abc import Callable

from meshserve.engine.config.speculative_config import SpeculativeConfig
from meshserve.engine.core.scheduler_output import (
    PLACEHOLDER_TOKEN,
    ScheduledSeq,
    SpecDecodeStats,
)
from meshserve.engine.core.sequence import Sequence, SequenceStatus
from meshserve.engine.spec.ngram_proposer import NgramProposer
from meshserve.engine.spec.speculation_switch import SpeculationSwitch

PAUSE_STEPS = 32
"""Decodes a sequence whose drafts kept failing runs plainly before it drafts again."""
PRIOR_STEPS = 2
"""The run's expected accepted drafts per verify step start at half of k, weighing as this
many verify steps."""
REQUEST_PRIOR_STEPS = 8
"""A request's expected accepted drafts per verify step start as the run's, weighing as
this many of its own verify steps. Acceptance comes in runs (a hard stretch of text fails
every draft, an easy one passes them all), so two failed verifies at a request's start
say little; with a lighter prior they priced one out of drafting for the rest of its
life at batch 1, where nothing else updates the price."""

StopStatus = Callable[[Sequence], "SequenceStatus | None"]
"""The scheduler's stop rules: a sequence's finished status after its newest token, if any."""


class DraftPlanner:
    """Drafts for one scheduler: n-gram proposals made here, or slots the draft model
    beside the target fills on the worker (speculative.method=draft)."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int,
                 switch_prior: Callable[[int], float] | None = None,
                 switch_probe_length: int = 1) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.proposer = (NgramProposer(spec.num_tokens, spec.prompt_lookup_min,
                                       spec.prompt_lookup_max)
                         if spec.method == "ngram" else None)
        """method=ngram: drafts made here. method=draft: the draft model beside the target
        makes them; the scheduler reserves their slots and says what the draft must feed."""
        self.draft_model = spec.method == "draft"
        self.switch = (SpeculationSwitch(switch_prior, switch_probe_length)
                       if spec.max_batch_size is None else None)
        """Whether a step drafts: its timed cost against the acceptance of its requests."""
        self.stats = SpecDecodeStats()
        self.num_missed_drafts = 0
        """Decodes of drafting steps whose proposer found nothing (Sequence's count)."""
        self.hold_slots = False
        """schedule()'s hold_draft_slots, for the step being scheduled."""
        self.draft_prompts = False
        """Whether this step's prompt chunks run on the draft model too: it drafts, or the
        batch they join may draft soon."""

    def accept(self, seq: Sequence, sched: ScheduledSeq, num_drafted: int, ok: list[int],
               token: int, stop_status: StopStatus, finished: list[Sequence]) -> int:
        """A verified step: append the accepted drafts and the token after them, up to the
        first stop among them (the rest are dropped); only the fed tokens that were
        accepted keep their KV. Returns the computed count."""
        seq.num_draft_tokens += num_drafted
        seq.num_accepted_tokens += len(ok)
        seq.num_verify_steps += 1
        self.stats.add(num_drafted, len(ok))
        self._pause_if_failing(seq, len(ok))
        for t in (*ok, token):
            seq.append_token(t)
            status = stop_status(seq)
            if status is not None:
                seq.set_finished(status)
                finished.append(seq)
                break
        # The last token fed and the accepted drafts hold KV; the newest token does not.
        seq.num_computed_tokens = min(sched.start_pos + 1 + len(ok), seq.num_tokens - 1)
        if sched.draft_context is not None:
            # The draft model fed the last token and its first num_drafts - 1 drafts: its KV
            # holds those of them that were accepted.
            seq.num_draft_computed = min(sched.start_pos + 1 + min(len(ok), num_drafted - 1),
                                         seq.num_computed_tokens)
        return seq.num_computed_tokens

    def may_draft(self, ready: list[Sequence], num_running: int) -> bool:
        """Whether a step of the `ready` sequences may carry drafts: up to
        speculative.max_batch_size of them where that is set, else where the switch prices
        drafting as paying, for them, at the batch size of all `num_running` (a pipeline's
        micro-batch costs what it does beside the others in flight)."""
        if self.spec.max_batch_size is not None:
            return len(ready) <= self.spec.max_batch_size
        assert self.switch is not None
        lag = (sum(s.num_computed_tokens - s.num_draft_computed for s in ready)
               if self.draft_model else 0)
        return self.switch.allow(self.acceptances(ready), lag, num_running)

    def may_draft_soon(self, num_seqs: int) -> bool:
        """Whether a batch of `num_seqs` may draft soon, by the switch (a fixed
        max_batch_size: whether it fits)."""
        if self.spec.max_batch_size is not None:
            return num_seqs <= self.spec.max_batch_size
        assert self.switch is not None
        return self.switch.may_draft_soon(num_seqs, self._run_accepted())

    def _run_accepted(self) -> float:
        """The run's accepted drafts per verify step so far, seeded at half of k."""
        return self._run_mean(self.stats.num_accepted_tokens, self.spec.num_tokens / 2)

    def _run_drafted(self) -> float:
        """The run's drafted tokens per verify step so far, seeded at k (a proposer may
        draft fewer: an n-gram match ends, the output nears max_tokens)."""
        return self._run_mean(self.stats.num_draft_tokens, self.spec.num_tokens)

    def _run_mean(self, total: float, seed: float, extra_steps: int = 0) -> float:
        """`total` per verify step of the run (and per each of `extra_steps` more), seeded
        with `seed` per step as PRIOR_STEPS steps."""
        return ((total + seed * PRIOR_STEPS)
                / (self.stats.num_drafts + extra_steps + PRIOR_STEPS))

    def acceptances(self, seqs: list[Sequence]) -> list[float | None]:
        """Per sequence, the drafts a drafting step can expect it to accept: its own mean
        per such step (a step where its proposer found nothing counts, with none), seeded
        (as REQUEST_PRIOR_STEPS steps) with the run's mean so far, itself seeded at half
        of speculative.num_tokens; None for one that would not draft."""
        seed = REQUEST_PRIOR_STEPS * self._run_mean(self.stats.num_accepted_tokens,
                                                    self.spec.num_tokens / 2,
                                                    self.num_missed_drafts)
        return [(s.num_accepted_tokens + seed)
                / (s.num_verify_steps + s.num_missed_drafts + REQUEST_PRIOR_STEPS)
                if s.speculate else None for s in seqs]

    def _pause_if_failing(self, seq: Sequence, num_accepted: int) -> None:
        """Stop drafting for a sequence whose drafts keep failing: its running acceptance
        rate (seeded with REQUEST_PRIOR_STEPS of the run's verify steps: its drafts
        and its accepted ones per step) below speculative.min_acceptance pauses it for
        PAUSE_STEPS decodes."""
        rate = ((seq.num_accepted_tokens + self._run_accepted() * REQUEST_PRIOR_STEPS)
                / (seq.num_draft_tokens + self._run_drafted() * REQUEST_PRIOR_STEPS))
        if num_accepted == 0 and rate < self.spec.min_acceptance:
            seq.speculate = False
            seq.plain_steps = 0

    def drafts(self, seq: Sequence, budget: int) -> tuple[list[int], int]:
        """Tokens to propose after `seq`'s last one this step (none when it is paused or
        nothing matches; never more than it may still emit), and the budget they hold:
        their count, or with hold_slots the slots they could have filled."""
        if not seq.speculate:
            if seq.num_draft_tokens:
                seq.plain_steps += 1  # a paused sequence tries again now and then
                if seq.plain_steps >= PAUSE_STEPS:
                    seq.speculate = True
            return [], 0
        room = min(self.spec.num_tokens, seq.max_tokens - seq.num_output_tokens - 1,
                   self.max_model_len - seq.num_tokens - 1, budget - 1)
        if room <= 0:
            return [], 0
        if self.proposer is None:  # the draft model fills these slots on the worker
            return [PLACEHOLDER_TOKEN] * room, room
        drafts = self.proposer.propose(seq.token_ids, room)
        if not drafts:
            seq.num_missed_drafts += 1
            self.num_missed_drafts += 1
        return drafts, room if self.hold_slots else len(drafts)

    def draft_context(self, seq: Sequence, start: int, end: int, drafting: bool
                      ) -> list[int] | None:
        """What the draft model feeds of `seq` before its tokens start..end this step: the
        tokens it lags by, where it drafts or where this is a prompt chunk of a sequence
        that may draft, joining a batch that may draft soon; else None (it sits out, and
        catches up when it next runs). Where drafting is priced out no draft forward
        runs at all."""
        decode = end - start == 1 and start >= seq.num_prompt_tokens
        if not drafting and (decode or not (self.draft_prompts and seq.speculate)):
            return None
        seq.num_draft_computed = min(seq.num_draft_computed, start)
        return seq.token_ids[seq.num_draft_computed:start]
