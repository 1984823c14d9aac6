"""A scheduled sequence as the model runner reads it (a ScheduledLike), for tests that
drive the runner without a scheduler."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Scheduled:
    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool = True
    num_drafts: int = 0
    prompt_targets: list[int] | None = None
