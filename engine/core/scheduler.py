"""Iteration-level scheduler: token budget, chunked prefill, preemption by recompute."""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque
from collections.abc import Callable, Mapping
from itertools import islice

from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.config.speculative_config import SpeculativeConfig
from meshserve.engine.core.block_manager import BlockManager, cdiv
from meshserve.engine.core.drafting import DraftPlanner
from meshserve.engine.core.scheduler_output import (
    PLACEHOLDER_TOKEN,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodeStats,
)
from meshserve.engine.core.sequence import Sequence, SequenceStatus
from meshserve.engine.core.step_budget import StepBudget
from meshserve.engine.spec.speculation_switch import SpeculationSwitch
from meshserve.validation import require


def _arrival_key(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival_time, seq.seq_id)


class Scheduler:
    """Chooses each step's sequences and KV blocks; pure Python, data in and data out.

    Invariants: `running` is in arrival order; a sequence in flight (scheduled, not yet
    updated) is neither scheduled again nor preempted; several outputs may be in flight.

    Async scheduling (one step in flight, overlapped with the host's work on the next):
    `advance` right after a step is launched counts its tokens as computed and gives each
    sampling sequence a PLACEHOLDER_TOKEN, so the next step can feed it before its value
    is known; `resolve` puts the sampled tokens in and applies the stop rules. A sequence
    holding a placeholder may be scheduled, never preempted or forked. One whose length
    limit the placeholder reaches stays in flight until resolved.
    """

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int,
                 sliding_window: int | None = None,
                 speculative: SpeculativeConfig | None = None,
                 step_budget: StepBudget | None = None,
                 switch_prior: Callable[[int], float] | None = None,
                 switch_probe_length: int = 1) -> None:
        """`sliding_window`: the model attends to that many latest tokens only, so blocks
        wholly behind every running query's window go back to the pool. `speculative`
        (ngram or draft): decodes of sequences marked `speculate` carry drafts to verify.
        `step_budget`: sets each step's token budget (engine.max_num_batched_tokens=auto).
        `switch_prior`, `switch_probe_length`: the speculation switch's (its docstrings)."""
        require(max_model_len >= 1, "max_model_len", max_model_len, "an int >= 1")
        self.config = config
        self.max_model_len = max_model_len
        self.sliding_window = sliding_window
        spec = speculative if speculative is not None and speculative.enabled else None
        self.drafting = (DraftPlanner(spec, max_model_len, switch_prior, switch_probe_length)
                         if spec is not None else None)
        """Speculative decoding's side of scheduling (None: no drafts)."""
        self._planned_drafting: bool | None = None
        """plan_drafting()'s decision for the next schedule() (None: it decides itself)."""
        self._no_spec_stats = SpecDecodeStats()
        self.step_budget = step_budget
        """engine.max_num_batched_tokens=auto: each step's token budget (None: the fixed
        max_num_batched_tokens)."""
        self.block_manager = BlockManager(num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching,
                                          sliding_window=sliding_window)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_deferred_admissions = 0
        """Admissions put off at least once to wait for a prefix another sequence computes."""
        self._seqs: dict[int, Sequence] = {}
        """Unfinished sequences by id."""
        self._in_flight: set[int] = set()
        self._unresolved: set[int] = set()
        """Sequences whose newest token is a placeholder (async scheduling)."""
        self._block_copies: list[tuple[int, int]] = []
        self._static_batch: set[int] = set()
        """'static' policy: ids of the batch now being served; new admissions wait for it."""
        self._deferred: dict[int, int] = {}
        """Waiting seq_id -> the pending block hash it was last deferred for."""

    @property
    def num_waiting(self) -> int:
        """Sequences waiting for admission (new or preempted)."""
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        """Admitted sequences, in flight or not."""
        return len(self.running)

    @property
    def num_in_flight(self) -> int:
        """Sequences scheduled and not yet updated."""
        return len(self._in_flight)

    def stats(self) -> SchedulerStats:
        """A snapshot of the counters."""
        bm = self.block_manager
        return SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running),
            num_in_flight=len(self._in_flight), num_preemptions=self.num_preemptions,
            num_deferred_admissions=self.num_deferred_admissions,
            num_used_blocks=bm.num_used_blocks, num_free_blocks=bm.num_free_blocks,
            prefix_cache=dataclasses.replace(bm.stats),
            spec=dataclasses.replace(self.spec_stats,
                                     accepted_per_position=list(
                                         self.spec_stats.accepted_per_position)))

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The speculative config when drafting is on."""
        return self.drafting.spec if self.drafting is not None else None

    @property
    def switch(self) -> SpeculationSwitch | None:
        """Whether a step drafts: its timed cost against the acceptance of its requests
        (None: off, or a fixed speculative.max_batch_size)."""
        return self.drafting.switch if self.drafting is not None else None

    @property
    def spec_stats(self) -> SpecDecodeStats:
        return self.drafting.stats if self.drafting is not None else self._no_spec_stats

    def reset_prefix_cache(self) -> int:
        """Uncache every unused cached KV block; return how many were freed."""
        return self.block_manager.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self._seqs)

    def get(self, seq_id: int) -> Sequence | None:
        """The unfinished sequence `seq_id`, or None."""
        return self._seqs.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; ValueError if it could never be served."""
        self._validate(seq)
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Drop a waiting or running sequence and free its blocks; None if unknown."""
        return self.finish(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish(self, seq_id: int, status: SequenceStatus) -> Sequence | None:
        """End a sequence with a FINISHED_* `status` (e.g. on a stop string); None if unknown."""
        require(status.is_finished, "status", status, "a FINISHED_* status")
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        seq.set_finished(status)
        self._retire(seq)
        return seq

    def fork(self, parent_id: int, child_seq_id: int) -> Sequence:
        """Start `child_seq_id` as a copy of running `parent_id`, sharing its KV blocks."""
        parent = self._seqs.get(parent_id)
        require(parent is not None and parent.status is SequenceStatus.RUNNING
                and parent_id not in self._in_flight and parent_id not in self._unresolved,
                "parent_id", parent_id, "a running sequence that is not in flight")
        require(child_seq_id not in self._seqs, "child_seq_id", child_seq_id, "an unused id")
        assert parent is not None
        child = parent.fork(child_seq_id)
        copy = self.block_manager.fork(parent, child)
        if copy is not None:
            self._block_copies.append(copy)
        self._seqs[child_seq_id] = child
        bisect.insort(self.running, child, key=_arrival_key)
        if parent_id in self._static_batch:
            self._static_batch.add(child_seq_id)
        return child

    def schedule(self, max_num_batched_tokens: int | None = None, *,
                 hold_draft_slots: bool = False) -> SchedulerOutput:
        """Pick the next step's chunks; `max_num_batched_tokens` may lower the budget
        (micro-batches). `hold_draft_slots`: a drafting decode takes the draft slots it may
        fill from the budget, filled or not (a micro-batch's budget is its share of the
        sequences, and prompt lookup fills a varying number of them)."""
        if self.drafting is not None:
            self.drafting.hold_slots = hold_draft_slots
        budget = self.config.step_token_cap
        if max_num_batched_tokens is not None:
            require(max_num_batched_tokens >= 1, "max_num_batched_tokens",
                    max_num_batched_tokens, "an int >= 1")
            budget = min(budget, max_num_batched_tokens)
        out = SchedulerOutput(block_copies=self._block_copies, num_running=len(self.running))
        self._block_copies = []
        num_decodes = 0
        if self.step_budget is not None:
            num_decodes, context = self._waiting_decodes()
            budget = out.token_budget = min(budget, self.step_budget.tokens(num_decodes,
                                                                             context))
        budget, blocked = self._schedule_running(out, budget, num_decodes)
        if not out.preempted_seq_ids and not blocked:
            self._schedule_waiting(out, budget)
        self._in_flight.update(s.seq_id for s in out.scheduled)
        return out

    def update(self, output: SchedulerOutput, sampled: Mapping[int, int],
               accepted: Mapping[int, list[int]] | None = None,
               num_drafted: Mapping[int, int] | None = None) -> list[Sequence]:
        """Apply a step's results (seq_id -> sampled token; with drafts, the accepted ones
        come first: `accepted[seq_id]`, of `num_drafted[seq_id]` verified, the slots
        reserved where not given); return the sequences that finished."""
        finished: list[Sequence] = []
        seqs, in_flight, bm = self._seqs, self._in_flight, self.block_manager
        caching, bs = bm.prefix_cache is not None, bm.block_size
        max_model_len, window = self.max_model_len, self.sliding_window
        for sched in output.scheduled:
            seq_id = sched.seq_id
            in_flight.discard(seq_id)
            seq = seqs.get(seq_id)
            if seq is None:
                continue  # aborted or finished while in flight
            start = sched.start_pos
            assert seq.num_computed_tokens == start, (seq, start)
            end = seq.num_computed_tokens = start + len(sched.token_ids)
            draft_before = seq.num_draft_computed
            if sched.draft_context is not None and not sched.num_drafts:
                seq.num_draft_computed = end  # the draft model ran this prompt chunk too
            if sched.num_drafts:
                n = num_drafted.get(seq_id, sched.num_drafts) if num_drafted else sched.num_drafts
                assert self.drafting is not None
                end = self.drafting.accept(seq, sched, n, (accepted or {}).get(seq_id, []),
                                           sampled[seq_id], self._stop_status, finished)
            elif sched.sample:
                token = sampled[seq_id]
                seq.append_token(token)
                # cheap pre-check; num_tokens == end + 1 now
                if (token in seq.stop_token_ids or len(seq.output_token_ids) >= seq.max_tokens
                        or end + 1 >= max_model_len):
                    status = self._stop_status(seq)
                    if status is not None:
                        seq.set_finished(status)
                        finished.append(seq)
            if sched.draft_context is not None:
                bm.mark_draft_computed(seq, draft_before, seq.num_draft_computed)
            if caching and end // bs != start // bs:  # a block was completed
                bm.cache_computed_blocks(seq)
            if window is not None and not seq.is_finished:
                bm.release_behind_window(seq, end)
        self._retire_all(finished)
        return finished

    def plan_drafting(self) -> bool:
        """Decide now whether the next schedule() may carry drafts, and keep the decision
        for it. Async scheduling asks before it schedules: a step that drafts must wait
        for the step in flight, one that does not is scheduled while it runs."""
        # With no decode to schedule no drafting step is in prospect, and the switch is
        # not asked (a pipeline fills its last slots with nothing, or with prompt chunks).
        ready = self._waiting_decodes()[0] > 0
        self._planned_drafting = self._may_draft() if ready else False
        return self._planned_drafting

    def _may_draft(self) -> bool:
        """Whether this step may carry drafts (drafting.may_draft over the running
        sequences it may schedule: a pipeline's micro-batches in flight hold the others)."""
        if self.drafting is None:
            return False
        in_flight = self._in_flight
        ready = ([s for s in self.running if s.seq_id not in in_flight] if in_flight
                 else self.running)
        return self.drafting.may_draft(ready, len(self.running))

    def _may_draft_soon(self) -> bool:
        """Whether the batch this step's prompts join (running and waiting sequences, to
        max_num_seqs) may draft soon."""
        if self.drafting is None:
            return False
        n = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return self.drafting.may_draft_soon(n)

    def advance(self, output: SchedulerOutput) -> None:
        """Async scheduling, first half of `update`, right after `output` was launched: its
        tokens count as computed and each sequence that samples gets a placeholder token.
        Call `resolve(output, ...)` with the sampled tokens before the next `advance`."""
        seqs, in_flight, unresolved, bm = self._seqs, self._in_flight, self._unresolved, \
            self.block_manager
        caching, bs = bm.prefix_cache is not None, bm.block_size
        for sched in output.scheduled:
            seq_id = sched.seq_id
            seq = seqs.get(seq_id)
            if seq is None:
                in_flight.discard(seq_id)
                continue  # aborted or finished while in flight
            start = sched.start_pos
            assert seq.num_computed_tokens == start, (seq, start)
            end = seq.num_computed_tokens = start + len(sched.token_ids)
            if sched.draft_context is not None and not sched.num_drafts:
                bm.mark_draft_computed(seq, seq.num_draft_computed, end)
                seq.num_draft_computed = end  # the draft model ran this prompt chunk too
            # Every token fed so far is known: the previous step was resolved before this.
            if caching and end // bs != start // bs:
                bm.cache_computed_blocks(seq)
            if self.sliding_window is not None:  # the launched step still reads from start
                bm.release_behind_window(seq, start)
            if sched.sample:
                seq.append_token(PLACEHOLDER_TOKEN)
                unresolved.add(seq_id)
                if (len(seq.output_token_ids) >= seq.max_tokens
                        or end + 1 >= self.max_model_len):
                    continue  # finishes when resolved, whatever the token: not schedulable
            in_flight.discard(seq_id)

    def resolve(self, output: SchedulerOutput, sampled: Mapping[int, int]) -> list[Sequence]:
        """Async scheduling, second half of `update`: put the tokens `output` sampled in
        place of their placeholders and apply the stop rules; return the finished sequences.

        A finished sequence may already be in the step launched after `output`: that step's
        token for it is dropped (its `advance` and `resolve` skip sequences that are gone)."""
        finished: list[Sequence] = []
        seqs, in_flight, unresolved = self._seqs, self._in_flight, self._unresolved
        for sched in output.scheduled:
            if not sched.sample:
                continue
            seq_id = sched.seq_id
            seq = seqs.get(seq_id)
            if seq is None or seq_id not in unresolved:
                if seq is None:
                    in_flight.discard(seq_id)
                continue  # aborted or finished meanwhile
            unresolved.discard(seq_id)
            assert seq.last_token_id == PLACEHOLDER_TOKEN, seq
            seq.set_last_token(sampled[seq_id])
            status = self._stop_status(seq)
            if status is not None:
                seq.set_finished(status)
                finished.append(seq)
                in_flight.discard(seq_id)
        self._retire_all(finished)
        return finished

    def _waiting_decodes(self) -> tuple[int, int]:
        """The running sequences that decode next step, and the KV tokens they read."""
        in_flight = self._in_flight
        n = context = 0
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens == 1 and seq.seq_id not in in_flight:
                n += 1
                context += seq.num_computed_tokens
        return n, context

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          reserved: int = 0) -> tuple[int, bool]:
        """Decodes and unfinished prefills of running sequences, oldest first; `reserved`
        of the budget is kept for decodes (an automatic budget: a prompt chunk of an older
        sequence never crowds a decode out).

        Returns the budget left and whether a sequence went without blocks (it waits for an
        in-flight sequence to come back and be preempted; no younger one may take blocks now).
        """
        # The hot path (one decode per sequence, every step): kept inline on purpose.
        running, in_flight, scheduled = self.running, self._in_flight, out.scheduled
        block_size = self.block_manager.block_size
        planned, self._planned_drafting = self._planned_drafting, None
        drafting = self.drafting
        # Drafts read every token before them: none while a token is still a placeholder.
        speculating = ((self._may_draft() if planned is None else planned)
                       and not self._unresolved)
        if drafting is not None:
            drafting.draft_prompts = speculating or self._may_draft_soon()
        # Drafts take what later decodes leave (a pipeline's micro-batch: its share of them).
        decodes_left = (self._waiting_decodes()[0] if drafting is not None and speculating
                        and not drafting.hold_slots else 0)
        num_batched = 0
        blocked = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            if seq.seq_id in in_flight:
                i += 1
                continue
            start = seq.num_computed_tokens
            end = num_tokens = seq.num_tokens
            room = budget
            if end - start == 1:
                reserved -= 1
                decodes_left -= 1
            else:
                room -= max(reserved, 0)
            if end - start > room:
                end = start + (self._num_new_tokens(end - start, room) if room > 0 else 0)
                if end == start:
                    i += 1
                    continue
            drafts, held = (drafting.drafts(seq, budget - max(decodes_left, 0))
                            if drafting is not None and speculating and end - start == 1
                            else ((), 0))
            fed = end - start + len(drafts)
            table = seq.block_table
            if len(table) * block_size < start + fed and (
                    blocked or not self._allocate_or_preempt(seq, fed, out)):
                if seq.status is SequenceStatus.RUNNING:
                    blocked = True
                    i += 1
                continue  # else `seq` itself was preempted and left `running`
            tokens = seq.token_ids[start:end]
            if drafts:
                tokens = [*tokens, *drafts]
            scheduled.append(ScheduledSeq(
                seq.seq_id, tokens, start, table[:], end == num_tokens, len(drafts),
                drafting.draft_context(seq, start, end, bool(drafts))
                if drafting is not None and drafting.draft_model else None,
                seq.prompt_targets(start, end) if seq.scores_prompt else None))
            num_batched += fed
            budget -= max(fed, end - start + held)
            i += 1
        out.num_batched_tokens += num_batched
        return budget, blocked

    def _allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> bool:
        """Find blocks for `seq` by preempting the latest arrivals; False if it must go without.

        The victim is always the latest-arrived running sequence (possibly `seq` itself); when
        that one is in flight nothing is preempted and `seq` waits, so the oldest sequence
        always progresses and in-flight micro-batches cannot make two sequences thrash.
        """
        bm, running, in_flight = self.block_manager, self.running, self._in_flight
        while not bm.allocate_slots(seq, num_new):
            if running[-1].seq_id in in_flight or running[-1].seq_id in self._unresolved:
                return False
            victim = self._preempt(len(running) - 1, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, j: int, out: SchedulerOutput) -> Sequence:
        """Send running[j] back to the front of waiting; its KV will be recomputed."""
        running = self.running
        victim = running.pop(j)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted_seq_ids.append(victim.seq_id)
        return victim

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order while budget, seats and blocks last.

        A sequence whose next block is being computed by a running one is deferred: it keeps
        its place and the ones behind it may go (see `_defer`). Any other sequence that does
        not fit stops admission, so the queue stays first come, first served.
        """
        waiting, bm = self.waiting, self.block_manager
        static = self.config.policy == "static"
        if static and not self._static_batch and not self.running:
            self._static_batch = {s.seq_id for s in islice(waiting, self.config.static_batch_size)}
        max_num_seqs = self.config.max_num_seqs
        deferred: list[Sequence] = []
        while waiting and budget > 0 and len(self.running) < max_num_seqs:
            seq = waiting[0]
            if static and seq.seq_id not in self._static_batch:
                break
            if self._still_deferred(seq):
                deferred.append(waiting.popleft())
                continue
            cached = bm.find_cached_prefix(seq)
            if self._defer(seq, len(cached)):
                deferred.append(waiting.popleft())
                continue
            num_cached_tokens = len(cached) * bm.block_size + bm.tail_rows(seq, len(cached))
            num_new = self._num_new_tokens(seq.num_tokens - num_cached_tokens, budget)
            if num_new == 0 or not bm.admit(seq, cached, num_new):
                break
            waiting.popleft()
            self._deferred.pop(seq.seq_id, None)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival_key)
            self._emit(out, seq, num_new)
            budget -= num_new
        waiting.extendleft(reversed(deferred))

    def _still_deferred(self, seq: Sequence) -> bool:
        """Whether the block `seq` was last deferred for is still pending (skips the lookup)."""
        block_hash = self._deferred.get(seq.seq_id)
        return block_hash is not None and self.block_manager.is_pending(block_hash)

    def _defer(self, seq: Sequence, num_cached_blocks: int) -> bool:
        """Whether waiting `seq` must wait for a block that a running sequence is computing.

        Rule: `seq` is deferred while the block right after its `num_cached_blocks` cached
        ones (a full block of its known tokens that a prefix-cache lookup could return) has
        the chained hash of a block that an admitted sequence will compute and has not
        registered yet. Once it is registered, `seq` hits it; so a sequence sharing a prefix
        with one prefilled in chunks is admitted when the whole shared part is registered,
        not block by block. No deadlock: only admitted sequences hold pending blocks, they
        never wait for waiting ones, and finish, abort or preemption drops their pending.
        """
        block_hash = self.block_manager.pending_block_hash(seq, num_cached_blocks)
        if block_hash is None:
            return False
        if seq.seq_id not in self._deferred:
            self.num_deferred_admissions += 1
        self._deferred[seq.seq_id] = block_hash
        return True

    def _num_new_tokens(self, num_remaining: int, budget: int) -> int:
        """Tokens to feed this step out of `num_remaining`; 0 means wait for more budget.

        With chunked prefill off a prefill waits until it fits whole, except a preempted
        sequence whose recompute exceeds the whole budget: it is chunked, or it never runs.
        """
        if num_remaining <= budget:
            return num_remaining
        config = self.config
        if config.enable_chunked_prefill or num_remaining > config.step_token_cap:
            return budget
        return 0

    def _emit(self, out: SchedulerOutput, seq: Sequence, num_new: int) -> None:
        start = seq.num_computed_tokens
        end = start + num_new
        # A hit or an import holds the draft's KV only where the draft computed it.
        seq.num_draft_computed = (self.block_manager.draft_valid_tokens(seq, start)
                                  if self.drafting is not None and self.drafting.draft_model
                                  else start)
        out.scheduled.append(ScheduledSeq(seq.seq_id, seq.token_ids[start:end], start,
                                          list(seq.block_table), end == seq.num_tokens,
                                          draft_context=self.drafting.draft_context(
                                              seq, start, end, False)
                                          if self.drafting is not None
                                          and self.drafting.draft_model else None,
                                          prompt_targets=seq.prompt_targets(start, end)))
        out.num_batched_tokens += num_new

    def _stop_status(self, seq: Sequence) -> SequenceStatus | None:
        num_outputs = len(seq.output_token_ids)
        if seq.last_token_id in seq.stop_token_ids and num_outputs >= seq.min_tokens:
            return SequenceStatus.FINISHED_STOPPED
        if num_outputs >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _retire_all(self, finished: list[Sequence]) -> None:
        """Retire sequences that finished in an update and drop them from `running`."""
        if finished:
            for seq in finished:
                self._retire(seq)
            self.running = [s for s in self.running if not s.is_finished]

    def _retire(self, seq: Sequence) -> None:
        """Forget a finished sequence and free its blocks (running list is the caller's)."""
        del self._seqs[seq.seq_id]
        if seq.seq_id in self._unresolved:  # ended before its last token came back
            self._unresolved.discard(seq.seq_id)
            seq.drop_last_token()
        self.block_manager.free(seq)
        self._static_batch.discard(seq.seq_id)
        self._deferred.pop(seq.seq_id, None)

    def _validate(self, seq: Sequence) -> None:
        config, bm = self.config, self.block_manager
        num_prompt = seq.num_prompt_tokens
        given = f"{num_prompt} tokens"
        require(num_prompt >= 1, "prompt_token_ids", given, "at least 1 token")
        require(num_prompt <= self.max_model_len, "prompt_token_ids", given,
                f"at most max_model_len={self.max_model_len} tokens")
        require(config.enable_chunked_prefill or num_prompt <= config.step_token_cap,
                "prompt_token_ids", given, f"at most max_num_batched_tokens="
                f"{config.step_token_cap} tokens when chunked prefill is off")
        cache_tokens = bm.num_blocks * bm.block_size
        require(cdiv(num_prompt, bm.block_size) <= bm.num_blocks, "prompt_token_ids", given,
                f"at most {cache_tokens} tokens (the whole KV cache)")
        require(seq.max_tokens >= 1, "max_tokens", seq.max_tokens, "an int >= 1")
        # The last sampled token is never fed back, so KV holds at most total length - 1.
        num_kv = max(num_prompt, min(num_prompt + seq.max_tokens, self.max_model_len) - 1)
        window = self.sliding_window
        if window is not None and config.enable_chunked_prefill:
            # A chunk (a recomputation's too) and the window behind it, a partial block at
            # either end: what a sequence holds at most, however long it grows.
            peak = cdiv(min(num_kv, config.step_token_cap + window), bm.block_size) + 1
            require(min(cdiv(num_kv, bm.block_size), peak) <= bm.num_blocks, "max_tokens",
                    seq.max_tokens, f"what {bm.num_blocks} KV blocks hold: a {window}-token "
                    f"window behind a chunk of max_num_batched_tokens="
                    f"{config.step_token_cap} needs {peak} blocks")
        else:
            require(cdiv(num_kv, bm.block_size) <= bm.num_blocks, "max_tokens", seq.max_tokens,
                    f"at most {cache_tokens - num_prompt + 1} for a {num_prompt}-token prompt:"
                    f" prompt and output must fit the KV cache of {cache_tokens} tokens")
        require(seq.seq_id not in self._seqs, "seq_id", seq.seq_id, "an id not already queued")
        require(seq.status is SequenceStatus.WAITING and not seq.block_table
                and seq.num_computed_tokens == 0 and not seq.output_token_ids,
                "seq", seq, "a new sequence (WAITING, no blocks, no output)")
