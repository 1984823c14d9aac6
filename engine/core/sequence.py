"""One request's tokens and scheduling state, as plain Python data."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        """Whether this status ends the sequence."""
        return self in _FINISHED


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class Sequence:
    """A prompt, the tokens generated so far, and the KV blocks that hold them."""

    __slots__ = (
        "seq_id", "prompt_token_ids", "max_tokens", "stop_token_ids", "min_tokens",
        "arrival_time", "output_token_ids", "status", "block_table", "num_computed_tokens",
        "num_cached_tokens", "num_preemptions", "finish_reason", "block_hashes", "_token_ids",
        "num_released_blocks", "speculate", "num_draft_tokens", "num_accepted_tokens",
        "plain_steps", "num_draft_computed", "num_verify_steps", "num_missed_drafts",
        "kv_tail", "keep_tail", "scores_prompt",
    )

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_token_ids: Iterable[int] = (),
        min_tokens: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.max_tokens = max_tokens
        self.stop_token_ids: frozenset[int] = frozenset(stop_token_ids)
        self.min_tokens = min_tokens
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_released_blocks = 0
        """Leading blocks of the table given back because attention no longer reads them
        (sliding window): their entries stay, as placeholders, so positions index as before."""
        self.speculate = False
        """Whether the scheduler may propose drafts for this sequence's decodes."""
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        """Drafted tokens verified for this sequence, and those accepted."""
        self.num_verify_steps = 0
        """Steps that verified drafts of it."""
        self.num_missed_drafts = 0
        """Decodes in drafting steps where its proposer found nothing to draft (prompt
        lookup without a match): they emit one token, as plain ones do."""
        self.plain_steps = 0
        """Decodes since its drafts last failed (speculation paused, retried later)."""
        self.num_draft_computed = 0
        """speculative.method=draft: leading tokens whose KV the draft model's cache holds
        (it runs every prefill chunk, and decodes only when drafting)."""
        self.num_computed_tokens = 0
        """Tokens whose KV is in the cache (prefix hits included)."""
        self.num_cached_tokens = 0
        """Prompt tokens served from the prefix cache at first admission."""
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.block_hashes: list[int] = []
        """Chained hashes of this sequence's leading full blocks; grows, never changes."""
        self._token_ids: list[int] = list(self.prompt_token_ids)
        self.kv_tail: int | None = None
        """A block this sequence holds a reference to outside its table: the KV of the
        prompt's tokens after its last full block. Arriving from another replica, it holds
        all but the last token's; the first admission takes it into the table, so only that
        token is computed (engine/replicas/kv_handoff.py). Kept at a finish (`keep_tail`), it holds
        what this replica computed, for the replica to send."""
        self.scores_prompt = False
        """Whether its prompt's tokens are scored (prompt log-probs): every prompt token is
        computed (no prefix-cache hit), and each chunk asks for its tokens' log-probs."""
        self.keep_tail = False
        """At a finish for its length, keep the block holding the prompt's partial last
        block (in `kv_tail`) rather than freeing it."""

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self._token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens (the live list: do not mutate)."""
        return self._token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Alias of `token_ids`."""
        return self._token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token."""
        return self._token_ids[-1]

    @property
    def is_finished(self) -> bool:
        """Whether the sequence has stopped for good."""
        return self.status in _FINISHED

    def append_token(self, token_id: int) -> None:
        """Add one generated token."""
        self._token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def drop_last_token(self) -> None:
        """Remove the newest generated token (a placeholder that will never be known)."""
        assert self.output_token_ids, self
        self._token_ids.pop()
        self.output_token_ids.pop()

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first `num_output_tokens` generated tokens (a stop met inside a
        run of accepted drafts); the sequence finishes right after."""
        drop = len(self.output_token_ids) - num_output_tokens
        if drop > 0:
            del self.output_token_ids[num_output_tokens:]
            del self._token_ids[len(self._token_ids) - drop:]

    def set_last_token(self, token_id: int) -> None:
        """Replace the newest generated token (async scheduling's placeholder, once known)."""
        assert self.output_token_ids, self
        self._token_ids[-1] = token_id
        self.output_token_ids[-1] = token_id

    def prompt_targets(self, start: int, end: int) -> list[int] | None:
        """A scored prompt's tokens whose log-probs a chunk [start, end) gives: those at
        positions start + 1 .. min(end, prompt length - 1); None where it is not scored,
        has output (a recompute after preemption: they were returned) or has none."""
        if not self.scores_prompt or self.output_token_ids:
            return None
        return self.prompt_token_ids[start + 1:min(end, self.num_prompt_tokens - 1) + 1] or None

    def set_finished(self, status: SequenceStatus) -> None:
        """Mark the sequence finished with `status` and its finish reason."""
        assert status.is_finished, status
        self.status = status
        self.finish_reason = FINISH_REASONS[status]

    def fork(self, seq_id: int) -> Sequence:
        """A copy under `seq_id` with the same tokens and progress, but no blocks of its own."""
        child = Sequence(seq_id, self.prompt_token_ids, max_tokens=self.max_tokens,
                         stop_token_ids=self.stop_token_ids, min_tokens=self.min_tokens,
                         arrival_time=self.arrival_time)
        child.output_token_ids = list(self.output_token_ids)
        child._token_ids = list(self._token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.num_draft_computed = self.num_draft_computed
        child.block_hashes = list(self.block_hashes)
        return child

    def __repr__(self) -> str:
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})")
