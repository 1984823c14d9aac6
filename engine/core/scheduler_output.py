"""What one scheduling step hands the model runner, and the scheduler's counters."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from meshserve.engine.core.prefix_cache import PrefixCacheStats

PLACEHOLDER_TOKEN = -1
"""Under async scheduling, a sampled token the host does not know yet: the step that feeds it
was scheduled while the step that samples it still ran. The executor feeds the token that
step sampled on the device in its place (`Scheduler.advance`, `Scheduler.resolve`)."""


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: tokens to feed at positions start_pos, start_pos+1, ...

    The model runner writes token i's KV to slot
    block_table[pos // block_size] * block_size + pos % block_size with pos = start_pos + i,
    and reads positions < start_pos back through the same table.
    """

    seq_id: int
    token_ids: list[int]
    """A prefill chunk, or the one decode token (PLACEHOLDER_TOKEN under async scheduling
    when the previous step sampled it and has not been resolved)."""

    start_pos: int
    """Position of token_ids[0]; the sequence's num_computed_tokens before the step."""

    block_table: list[int]
    """A copy of the sequence's block table, covering every position fed."""

    sample: bool
    """Whether this chunk ends the known tokens, so the model samples the next one."""

    num_drafts: int = 0
    """Speculative decoding: the last num_drafts of token_ids are proposed, not known; the
    model gives logits at each of the last num_drafts + 1 positions to verify them."""

    draft_context: list[int] | None = None
    """speculative.method=draft: None where the draft model skips this sequence this step;
    else the tokens before token_ids[0] whose KV the draft lacks (it skipped plain decodes).
    The draft feeds them and the known tokens, from start_pos - len(draft_context), and
    where num_drafts > 0 proposes them (the scheduler's are placeholders)."""

    prompt_targets: list[int] | None = None
    """A scored prompt (prompt log-probs): the prompt tokens after this chunk's first
    `len(prompt_targets)` positions, one per position, whose log-probs the logits there
    give (the prompt's first token has none; the chunk's last row, where it samples,
    predicts no prompt token)."""

    @property
    def num_tokens(self) -> int:
        """Tokens fed this step."""
        return len(self.token_ids)

    @property
    def drafts(self) -> list[int]:
        """The proposed tokens: the last num_drafts of token_ids (none when 0)."""
        return self.token_ids[len(self.token_ids) - self.num_drafts:]


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch: scheduled chunks, preempted sequences and block copies to do first."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    num_batched_tokens: int = 0
    """Sum of len(token_ids) over `scheduled`."""

    preempted_seq_ids: list[int] = field(default_factory=list)
    """Sequences sent back to waiting (their KV is dropped and will be recomputed)."""

    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) whole-block KV copies (from forks) to perform before this step's forward."""

    token_budget: int | None = None
    """The token budget an automatic step budget gave this step (None: the fixed one)."""

    num_running: int = 0
    """Running sequences when the step was scheduled, a pipeline's in flight included: the
    batch size the speculation switch prices the step at."""

    @property
    def num_seqs(self) -> int:
        """Sequences in the step."""
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Whether there is nothing to run (no tokens and no copies)."""
        return not self.scheduled and not self.block_copies


@dataclass(slots=True)
class SpecDecodeStats:
    """Drafts verified so far: verify steps of a sequence, tokens drafted and accepted, and
    accepted tokens by their position in the draft (0 is the first drafted token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per = self.accepted_per_position
        if len(per) < num_drafted:
            per.extend([0] * (num_drafted - len(per)))
        for j in range(num_accepted):
            per[j] += 1


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot of the scheduler's counters."""

    num_waiting: int
    num_running: int
    num_in_flight: int
    """Running sequences scheduled but not yet updated."""

    num_preemptions: int
    num_deferred_admissions: int
    """Admissions put off to wait for a prefix block another sequence was computing."""

    num_used_blocks: int
    """KV blocks held by some sequence."""

    num_free_blocks: int
    """Free plus evictable (cached, unused) KV blocks."""

    prefix_cache: PrefixCacheStats

    spec: SpecDecodeStats = field(default_factory=lambda: SpecDecodeStats())
    """Speculative decoding's counters (all zero without it)."""

    def as_dict(self) -> dict[str, float]:
        """Flat counters for logs and metrics (prefix-cache ones prefixed `prefix_cache_`)."""
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)
                                 if f.name not in ("prefix_cache", "spec")}
        for f in fields(self.prefix_cache):
            out[f"prefix_cache_{f.name}"] = getattr(self.prefix_cache, f.name)
        out["prefix_cache_hit_rate"] = self.prefix_cache.hit_rate
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[f"spec_{name}"] = getattr(self.spec, name)
        return out
