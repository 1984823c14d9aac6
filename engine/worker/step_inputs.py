"""Turns a scheduled step (pure Python) into the tensors one forward pass needs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from meshserve.models.attention import AttentionMetadata, PrefillChunk


class ScheduledLike(Protocol):
    """What the runner reads of a scheduled sequence."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    num_drafts: int
    prompt_targets: list[int] | None


@dataclass(frozen=True, slots=True)
class PromptRows:
    """The rows of a step whose logits score prompt tokens (prompt log-probs), by chunk."""

    seq_ids: list[int]
    starts: list[int]
    """Each chunk's first scored position: its start_pos + 1."""
    targets: list[list[int]]
    """Each chunk's scored tokens, one per row from its first row."""
    rows: list[int]
    """Their rows in the step's hidden states, chunk after chunk."""

    @property
    def num_rows(self) -> int:
        return len(self.rows)


@dataclass
class StepInputs:
    """One forward pass: tokens ordered decodes first, then prefill chunks. A decode with
    drafts is num_drafts + 1 decode rows, each attending up to its own position (the step
    writes every row's KV before attending): a verify step is a decode step."""

    input_ids: torch.Tensor
    """[T] token ids."""
    positions: torch.Tensor
    """[T] positions."""
    meta: AttentionMetadata
    """Cache slots and attention spans."""
    sample_indices: torch.Tensor
    """Rows of the hidden states whose logits are sampled: each sequence's last token, and
    with drafts the num_drafts before it too."""
    sample_seq_ids: list[int]
    """The sequences those rows belong to, in the same order (a speculating sequence once
    per row)."""
    order: list[int]
    """Scheduled-sequence indices in token order."""
    num_decode_seqs: int = 0
    """The first this-many of `order` are decodes (with their drafts, if any)."""
    prompt: PromptRows | None = None
    """Rows that score prompt tokens, gathered after the sampled ones (None: no chunk
    asks)."""

    @property
    def num_logit_rows(self) -> int:
        """Rows of `logit_rows`: the sampled ones, then the scoring ones."""
        return len(self.sample_seq_ids) + (self.prompt.num_rows if self.prompt else 0)

    def logit_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of `hidden` [T, ...] that the LM head reads: those that sample, then
        those that score prompt tokens; `hidden` as it is when every token samples (a
        decode-only step: no gather kernel), else gathered."""
        if self.prompt is None and len(self.sample_seq_ids) == hidden.shape[0]:
            return hidden  # increasing rows of T, all T of them
        return hidden[self.sample_indices]


def to_device(x: list[int] | list[list[int]] | list[float] | list[bool], device: torch.device,
              dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A tensor on `device`; on CUDA staged in pinned memory and copied without a sync (the
    host does not wait for the work already queued)."""
    cpu = torch.tensor(x, dtype=dtype)
    if device.type != "cuda":
        return cpu if device.type == "cpu" else cpu.to(device)
    return cpu.pin_memory().to(device, non_blocking=True)


def build_step_inputs(seqs: Sequence[ScheduledLike], block_size: int,
                      device: torch.device) -> StepInputs:
    """Flatten `seqs` into input ids, positions, slot mapping and attention metadata."""
    decodes = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1 + s.num_drafts]
    prefills = [i for i, s in enumerate(seqs) if len(s.token_ids) != 1 + s.num_drafts]
    order = decodes + prefills
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[int] = []
    scored = PromptRows([], [], [], [])
    for i in order:
        s = seqs[i]
        if s.prompt_targets:
            scored.seq_ids.append(s.seq_id)
            scored.starts.append(s.start_pos + 1)
            scored.targets.append(s.prompt_targets)
            scored.rows.extend(range(len(ids), len(ids) + len(s.prompt_targets)))
        table = s.block_table
        for p in range(s.start_pos, s.start_pos + len(s.token_ids)):
            slots.append(table[p // block_size] * block_size + p % block_size)
        pos.extend(range(s.start_pos, s.start_pos + len(s.token_ids)))
        ids.extend(s.token_ids)
        if s.sample:
            n = s.num_drafts + 1
            sample_rows.extend(range(len(ids) - n, len(ids)))
            sample_ids.extend([s.seq_id] * n)
    dec = [seqs[i] for i in decodes]
    width = max((len(s.block_table) for s in dec), default=1)
    tables: list[list[int]] = []
    lens: list[int] = []
    for s in dec:
        row = s.block_table + [0] * (width - len(s.block_table))
        for j in range(1 + s.num_drafts):
            tables.append(row)
            lens.append(s.start_pos + 1 + j)
    chunks = []
    start = len(lens)
    for i in prefills:
        s = seqs[i]
        chunks.append(PrefillChunk(start, len(s.token_ids), s.start_pos,
                                   to_device(s.block_table, device)))
        start += len(s.token_ids)

    def t(x: list[int] | list[list[int]]) -> torch.Tensor:
        return to_device(x, device)

    meta = AttentionMetadata(
        slot_mapping=t(slots), num_decode_tokens=len(lens),
        decode_block_tables=t(tables) if dec else torch.zeros(0, 1, dtype=torch.long,
                                                              device=device),
        decode_context_lens=t(lens), prefills=chunks)
    prompt = scored if scored.rows else None
    return StepInputs(t(ids), t(pos), meta, t(sample_rows + scored.rows), sample_ids, order,
                      len(dec), prompt)
