"""Decode under CUDA graphs: one graph per bucketed batch size over static input buffers.

A decode-only step of n sequences runs the graph of the smallest captured size >= n.
Its inputs are copied (device to device, asynchronously) into the static buffers and
the rows past n are padding that touches nothing: slot -1 (the KV write skips it),
context length 0 (attention returns zeros), token and position 0. Block tables are as
wide as max_model_len allows, so the decode kernel's split count is fixed per graph.
Only the Triton kernels are captured: the runner enables graphs on CUDA only.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from meshserve.engine.worker.step_inputs import ScheduledLike
from meshserve.models.attention import AttentionMetadata

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
"""(input_ids [B], positions [B], meta) -> hidden [B, hidden]."""


def graph_batch_sizes(max_num_seqs: int, largest: int = 256) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to min(max_num_seqs,
    largest); the cap itself is included so every batch the scheduler forms has a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs}: allowed is an int >= 1")
    cap = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def bucket_for(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= batch_size, or None if the batch is too large."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeBuffers:
    """Static inputs of the captured graphs, sized for the largest batch."""

    input_ids: torch.Tensor
    """[max_batch] long."""
    positions: torch.Tensor
    """[max_batch] long."""
    slot_mapping: torch.Tensor
    """[max_batch] long; -1 on padding rows."""
    block_tables: torch.Tensor
    """[max_batch, max_blocks_per_seq] long."""
    context_lens: torch.Tensor
    """[max_batch] long; 0 on padding rows."""

    flat: torch.Tensor
    """[4 * max_batch + max_batch * max_blocks_per_seq] long: the tensors above are views of
    it (ids, positions, slots, context lengths, then the tables), so one host->device copy
    of a packed host buffer fills them all."""

    @classmethod
    def allocate(cls, max_batch: int, max_blocks_per_seq: int,
                 device: torch.device) -> DecodeBuffers:
        """Zeroed buffers with every row marked as padding."""
        b = max_batch
        flat = torch.zeros(4 * b + b * max_blocks_per_seq, dtype=torch.long, device=device)
        bufs = cls(flat[:b], flat[b:2 * b], flat[2 * b:3 * b],
                   flat[4 * b:].view(b, max_blocks_per_seq), flat[3 * b:4 * b], flat)
        bufs.slot_mapping.fill_(-1)
        return bufs

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             bucket: int) -> None:
        """Copy a decode step's n rows in and mark rows n..bucket as padding (no host sync)."""
        n = input_ids.shape[0]
        width = meta.decode_block_tables.shape[1]
        if n > bucket or bucket > self.input_ids.shape[0]:
            raise ValueError(f"{n} rows do not fit bucket {bucket} of buffers for "
                             f"{self.input_ids.shape[0]}")
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block tables {width} wide exceed the captured width "
                             f"{self.block_tables.shape[1]} (max_model_len / block_size)")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables, non_blocking=True)
        self.context_lens[:n].copy_(meta.decode_context_lens, non_blocking=True)
        # Columns past `width` keep stale ids: the kernel reads only cdiv(context, block) of them.
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.context_lens[n:bucket].zero_()

    def max_batch(self) -> int:
        return self.input_ids.shape[0]

    def meta(self, bucket: int) -> AttentionMetadata:
        """Metadata viewing the first `bucket` rows (what a graph of that size captures)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], num_decode_tokens=bucket,
            decode_block_tables=self.block_tables[:bucket],
            decode_context_lens=self.context_lens[:bucket], prefills=[])


class PackedInputs:
    """Pinned host images of DecodeBuffers.flat, filled from scheduled sequences in Python
    and sent with one non-blocking copy. Two of them alternate; an event guards each, so a
    buffer is never rewritten while its copy may still be in flight."""

    def __init__(self, buffers: DecodeBuffers) -> None:
        self.buffers = buffers
        self.host = [torch.zeros(buffers.flat.shape, dtype=torch.long).pin_memory()
                     for _ in range(2)]
        self.views = [h.numpy() for h in self.host]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def send(self, seqs: Sequence[ScheduledLike], block_size: int, bucket: int) -> None:
        """Write the decode rows of `seqs` (one token each) and padding up to `bucket`."""
        i, self.turn = self.turn, self.turn ^ 1
        if (event := self.events[i]) is not None:
            event.synchronize()
        b = self.buffers.max_batch()
        width = self.buffers.block_tables.shape[1]
        a = self.views[i]
        ids, pos, slots, ctx = a[:b], a[b:2 * b], a[2 * b:3 * b], a[3 * b:4 * b]
        tables = a[4 * b:].reshape(b, width)
        for r, s in enumerate(seqs):
            p, table = s.start_pos, s.block_table
            ids[r] = s.token_ids[0]
            pos[r] = p
            slots[r] = table[p // block_size] * block_size + p % block_size
            ctx[r] = p + 1
            tables[r, :len(table)] = table
        n = len(seqs)  # padding rows: token 0, slot -1 (not written), context 0 (no keys)
        ids[n:bucket] = 0
        pos[n:bucket] = 0
        slots[n:bucket] = -1
        ctx[n:bucket] = 0
        end = 4 * b + bucket * width
        self.buffers.flat[:end].copy_(self.host[i][:end], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.events[i] = event


class DecodeGraphs:
    """Captured decode graphs of one model, replayed for decode-only steps."""

    def __init__(self, forward: Forward, sizes: list[int], max_blocks_per_seq: int,
                 device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; got {device}")
        self.forward = forward
        self.sizes = sorted(sizes)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], max_blocks_per_seq, device)
        self.packed = PackedInputs(self.buffers)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture_all()

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.sizes):  # largest first: later graphs reuse its pool
            ids, pos, meta = self._inputs(bucket)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up: Triton compiles outside the capture
                self.forward(ids, pos, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(ids, pos, meta)
            self.graphs[bucket] = (graph, out)
        torch.cuda.synchronize()

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        b = self.buffers
        return b.input_ids[:bucket], b.positions[:bucket], b.meta(bucket)

    def can_run(self, meta: AttentionMetadata) -> bool:
        """A decode-only step that fits a captured size and the captured table width."""
        return (not meta.prefills and 0 < meta.num_decode_tokens <= self.sizes[-1]
                and meta.decode_block_tables.shape[1] <= self.buffers.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step (the graph's output rows, a view)."""
        n = input_ids.shape[0]
        bucket = bucket_for(n, self.sizes)
        assert bucket is not None and self.can_run(meta)
        self.buffers.fill(input_ids, positions, meta, bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:n]

    def fits(self, seqs: Sequence[ScheduledLike]) -> bool:
        """A decode-only step (one token per sequence, none scoring a prompt token) within
        a captured size and width."""
        return (0 < len(seqs) <= self.sizes[-1]
                and all(len(s.token_ids) == 1 and not s.prompt_targets for s in seqs)
                and max(len(s.block_table) for s in seqs) <= self.buffers.block_tables.shape[1])

    def run_scheduled(self, seqs: Sequence[ScheduledLike], block_size: int,
                      patch_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step given as scheduled sequences
        (`fits`): its inputs go packed in one host->device copy, `patch_ids` may then change
        the static input ids on the device (tokens the host does not know yet), then the
        graph replays."""
        n = len(seqs)
        bucket = bucket_for(n, self.sizes)
        assert bucket is not None
        self.packed.send(seqs, block_size, bucket)
        if patch_ids is not None:
            patch_ids(self.buffers.input_ids)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out[:n]
