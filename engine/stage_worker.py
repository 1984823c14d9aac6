"""One rank's share of a multi-rank model: its stage's layers (its TP shard), their KV
cache, and on the sampling rank the per-sequence samplers. Driver and workers alike run
every micro-batch through `StageWorker.run`."""

from __future__ import annotations

from dataclasses import dataclass, field
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
from meshserve.models.loader import load_model
from meshserve.parallel.mesh import ProcessGroups
from meshserve.parallel.p2p import StageLink


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


class StageWorker:
    """This rank's layers [start, end) of the model, their KV cache and (sampling rank)
    the samplers; `allocate(num_blocks)` must follow once every rank agreed on the count."""

    def __init__(self, config: MeshConfig, model_dir: Path, groups: ProcessGroups,
                 layer_range: tuple[int, int], device: torch.device, dtype: torch.dtype,
                 max_in_flight: int, progress: bool = False) -> None:
        self.config, self.groups, self.device, self.dtype = config, groups, device, dtype
        self.model = load_model(model_dir, dtype=dtype, tp=groups.tp, layer_range=layer_range,
                                device=device, progress=progress,
                                cpu_weight_layout=config.model.cpu_weight_layout)
        self.hidden_size = self.model.arch.hidden_size
        pp = groups.dims.pp
        self.link = StageLink(
            groups.pp_group,
            groups.stage_rank(groups.pp_rank - 1) if groups.pp_rank > 0 else None,
            groups.stage_rank(groups.pp_rank + 1) if groups.pp_rank < pp - 1 else None,
            max_pending=max_in_flight + 1, timeout=groups.op_timeout)
        self.sampler = StepSampler(device, config.engine.seed) if groups.is_sampler else None
        self.runner: ModelRunner | None = None
        self.num_blocks = 0

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
                                  attn.num_kv_heads, attn.head_dim, self.dtype, self.device)
        self.runner = ModelRunner(self.model, cache, self.config.engine.block_size, self.device)
        self.num_blocks = num_blocks

    @torch.inference_mode()
    def run(self, msg: StepMessage) -> StepResult | None:
        """Run this stage on a micro-batch: receive activations (later stages), run the
        layers, pass them on (earlier stages) or sample; the sampling rank returns tokens."""
        runner = self.runner
        assert runner is not None, "allocate() first"
        if self.sampler is not None:
            self.sampler.track(msg.new_params, msg.finished)
        runner.copy_blocks(msg.block_copies)
        inputs = build_step_inputs(msg.scheduled, runner.block_size, self.device)
        hidden = residual = None
        if not self.groups.is_first_stage:
            try:
                hidden, residual = self.link.recv(msg.num_tokens, self.hidden_size, self.dtype,
                                                  self.device)
            except RuntimeError as e:
                prev = self.groups.describe(self.link.prev_rank)
                raise RankFailure(f"no activations from {prev}: {failure_reason(e)}") from e
        hidden, residual = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                                      hidden, residual)
        if not self.groups.is_last_stage:
            assert residual is not None
            self.link.send(hidden, residual)
            return None
        if not inputs.sample_seq_ids:
            return StepResult() if self.sampler is not None else None
        logits = self.model.compute_logits(inputs.sampled_rows(hidden))
        if self.sampler is None:
            return None
        assert logits is not None
        return self.sampler.sample(logits, inputs.sample_seq_ids)

    def drain(self) -> None:
        """Wait until the next stage took every activation this rank sent."""
        self.link.drain()
