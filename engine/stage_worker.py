"""One rank's share of a multi-rank model: its stage's layers (its TP shard), their KV
cache, and on the sampling rank the per-sequence samplers. Driver and workers alike run
every micro-batch through `StageWorker.run`."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from meshserve.engine.executor import StepResult, StepSampler
from meshserve.engine.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks
from meshserve.engine.model_runner import ModelRunner
from meshserve.engine.sampling_params import SamplingParams
from meshserve.engine.scheduler_output import ScheduledSeq
from meshserve.engine.step_inputs import build_step_inputs
from meshserve.launch.ranks import RankFailure, failure_reason
from meshserve.launch.run_config import MeshConfig
from meshserve.models.arch import ModelArch
from meshserve.models.loader import load_model
from meshserve.parallel.mesh import ProcessGroups
from meshserve.parallel.p2p import StageLink, TensorChannel
from meshserve.parallel.planner import lm_head_split


@dataclass(slots=True)
class StepMessage:
    """One micro-batch as the driver broadcasts it to every rank of its replica."""

    step_id: int
    scheduled: list[ScheduledSeq]
    num_tokens: int
    """Tokens fed this step: the rows of the activations passed between stages."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    new_params: dict[int, SamplingParams] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StatsRequest:
    """Broadcast by the driver between steps: every rank answers with its StageStats."""

    request_id: int


@dataclass(frozen=True, slots=True)
class StageStats:
    """Where one rank's time went since it started serving (seconds, summed)."""

    rank: int
    pp_rank: int
    tp_rank: int
    busy_s: float = 0.0
    """Running micro-batches: its layers, their collectives, sampling; waits excluded."""
    input_wait_s: float = 0.0
    """Waiting for the previous stage's activations (a pipeline bubble)."""
    num_micro_batches: int = 0

    def minus(self, earlier: StageStats) -> StageStats:
        """The time spent between `earlier` (the same rank's) and this snapshot."""
        assert earlier.rank == self.rank, (earlier.rank, self.rank)
        return replace(self, busy_s=self.busy_s - earlier.busy_s,
                       input_wait_s=self.input_wait_s - earlier.input_wait_s,
                       num_micro_batches=self.num_micro_batches - earlier.num_micro_batches)


class StageWorker:
    """This rank's layers [start, end) of the model, their KV cache and (sampling rank)
    the samplers; `allocate(num_blocks)` must follow once every rank agreed on the count."""

    def __init__(self, config: MeshConfig, model_dir: Path, groups: ProcessGroups,
                 layer_range: tuple[int, int], device: torch.device, dtype: torch.dtype,
                 max_in_flight: int, progress: bool = False) -> None:
        self.config, self.groups, self.device, self.dtype = config, groups, device, dtype
        arch = ModelArch.from_dir(model_dir)
        self.head_split = lm_head_split(config, arch.vocab_size, device.type)
        self.model = load_model(model_dir, dtype=dtype, tp=groups.tp, layer_range=layer_range,
                                device=device, progress=progress,
                                cpu_weight_layout=config.model.cpu_weight_layout,
                                head_split=self.head_split,
                                huge_pages=config.engine.cpu_huge_pages)
        self.hidden_size = arch.hidden_size
        self.vocab_size = arch.vocab_size
        pp, rank = groups.dims.pp, groups.rank
        prev = groups.stage_rank(groups.pp_rank - 1) if groups.pp_rank > 0 else None
        nxt = groups.stage_rank(groups.pp_rank + 1) if groups.pp_rank < pp - 1 else None
        self.link = StageLink(groups.pp_group, prev, nxt, max_pending=max_in_flight + 1,
                              timeout=groups.op_timeout,
                              ring_in=groups.rings.get(("act", prev, rank)) if prev is not None
                              else None,
                              ring_out=groups.rings.get(("act", rank, nxt)) if nxt is not None
                              else None, watch=groups.watch)
        self.sampler = StepSampler(device, config.engine.seed) if groups.is_sampler else None
        # Split head: the last stage's rows and logits go to the driver, which samples.
        self.logits: TensorChannel | None = None
        self._awaiting: deque[list[int]] = deque()  # driver: seq ids of micro-batches in flight
        if self.head_split is not None and groups.rank in (groups.driver_rank,
                                                           groups.last_stage_rank):
            src, dst = groups.last_stage_rank, groups.driver_rank
            peer = dst if groups.rank == src else src
            self.logits = TensorChannel(groups.result_group, peer, 2 * (max_in_flight + 1),
                                        groups.op_timeout,
                                        ring=groups.rings.get(("result", src, dst)),
                                        alive=groups.watch(peer))
        self.runner: ModelRunner | None = None
        self.num_blocks = 0
        self._busy_s = self._input_wait_s = 0.0
        self._num_micro_batches = 0

    def stats(self) -> StageStats:
        """This rank's time so far."""
        g = self.groups
        return StageStats(g.rank, g.pp_rank, g.tp_rank, self._busy_s, self._input_wait_s,
                          self._num_micro_batches)

    def local_num_blocks(self) -> int:
        """KV blocks this rank's memory budget holds for its layers."""
        layers = self.model.attention_layers()
        attn = layers[0]
        block_bytes = bytes_per_block(len(layers), attn.num_kv_heads, attn.head_dim,
                                      self.config.engine.block_size, self.dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return num_kv_blocks(self.config.engine, block_bytes, self.device, weight_bytes)

    def allocate(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks (the same count on every rank) for this stage."""
        layers = self.model.attention_layers()
        attn = layers[0]
        cache = allocate_kv_cache(len(layers), num_blocks, self.config.engine.block_size,
                                  attn.num_kv_heads, attn.head_dim, self.dtype, self.device,
                                  self.config.engine.cpu_huge_pages)
        self.runner = ModelRunner(self.model, cache, self.config.engine.block_size, self.device)
        self.num_blocks = num_blocks

    @torch.inference_mode()
    def run(self, msg: StepMessage) -> StepResult | None:
        """Run this stage on a micro-batch: receive activations (later stages), run the
        layers, pass them on (earlier stages) or sample; the sampling rank returns tokens."""
        t0 = time.perf_counter()
        waited = 0.0
        try:
            result, waited = self._run(msg)
        finally:
            self._busy_s += time.perf_counter() - t0 - waited
            self._input_wait_s += waited
            self._num_micro_batches += 1
        return result

    def _run(self, msg: StepMessage) -> tuple[StepResult | None, float]:
        """run() and the seconds it waited for activations."""
        runner = self.runner
        assert runner is not None, "allocate() first"
        waited = 0.0
        if self.sampler is not None:
            self.sampler.track(msg.new_params, msg.finished)
        runner.copy_blocks(msg.block_copies)
        inputs = build_step_inputs(msg.scheduled, runner.block_size, self.device)
        hidden = residual = None
        if not self.groups.is_first_stage:
            t0 = time.perf_counter()
            try:
                hidden, residual = self.link.recv(msg.num_tokens, self.hidden_size, self.dtype,
                                                  self.device)
                waited = time.perf_counter() - t0
            except RuntimeError as e:
                prev = self.groups.describe(self.link.prev_rank)
                raise RankFailure(f"no activations from {prev}: {failure_reason(e)}") from e
        hidden, residual = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                                      hidden, residual)
        if not self.groups.is_last_stage:
            assert residual is not None
            self.link.send(hidden, residual)
            if self.logits is not None:  # the driver of a split head: collect_sampled() next
                self._awaiting.append(inputs.sample_seq_ids)
            return None, waited
        if self.logits is not None:  # the last stage of a split head: rows, then logits, on
            if inputs.sample_seq_ids:  # (the driver's part runs while this one does)
                rows = inputs.sampled_rows(hidden)
                self.logits.send([rows])
                part = self.model.compute_logits(rows)
                assert part is not None
                self.logits.send([part])
            return None, waited
        if not inputs.sample_seq_ids:
            return (StepResult() if self.sampler is not None else None), waited
        logits = self.model.compute_logits(inputs.sampled_rows(hidden))
        if self.sampler is None:
            return None, waited
        assert logits is not None
        return self.sampler.sample(logits, inputs.sample_seq_ids), waited

    @torch.inference_mode()
    def collect_sampled(self) -> StepResult:
        """(Driver of a split LM head) Tokens of the oldest micro-batch in flight: the last
        stage's normed rows arrive, this stage computes its part of the logits (while the
        last stage computes the other part), adds the last stage's part and samples.
        Waiting for either counts as input wait, the rest as busy."""
        assert self.logits is not None and self.sampler is not None and self._awaiting
        seq_ids = self._awaiting.popleft()
        if not seq_ids:
            return StepResult()
        assert self.head_split is not None
        t0 = time.perf_counter()
        n = len(seq_ids)
        rows = self.logits.recv((n, self.hidden_size), self.dtype, self.device)
        t1 = time.perf_counter()
        first = self.model.compute_logits(rows)
        assert first is not None
        t2 = time.perf_counter()
        part = self.logits.recv((n, self.vocab_size - self.head_split), self.dtype,
                                self.device)
        t3 = time.perf_counter()
        result = self.sampler.sample(torch.cat([first, part], dim=-1), seq_ids)
        self._input_wait_s += (t1 - t0) + (t3 - t2)
        self._busy_s += (t2 - t1) + (time.perf_counter() - t3)
        return result

    def drain(self) -> None:
        """Wait until the next stage took every activation this rank sent (and the driver
        every logits message)."""
        self.link.drain()
        if self.logits is not None and self.groups.rank == self.groups.last_stage_rank:
            self.logits.drain()
