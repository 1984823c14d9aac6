"""Executors run a scheduled step on the model, wherever its ranks are.

The engine (scheduler, requests, detokenization) is the same for every layout; an
executor owns the model shard(s), the KV cache and the sampler. `LocalExecutor` runs the
whole model in this process; multi-rank executors fan the same step out to their ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from meshserve.engine.host_memory import tune_malloc
from meshserve.engine.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks
from meshserve.engine.model_runner import ModelRunner
from meshserve.engine.sampled_tokens import Logprob, SampledTokens
from meshserve.engine.sampler import Sampler
from meshserve.engine.sampling_params import SamplingParams
from meshserve.engine.scheduler_output import SchedulerOutput
from meshserve.engine.warmup import warm_up
from meshserve.kernels import dispatch
from meshserve.launch.run_config import MeshConfig
from meshserve.models.arch import ModelArch
from meshserve.models.llama import LlamaForCausalLM
from meshserve.models.loader import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepResult:
    """Tokens sampled in one step, by sequence id."""

    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, Logprob] = field(default_factory=dict)


class Executor(Protocol):
    """What the engine needs from whoever runs the model."""

    num_blocks: int
    device: torch.device

    def execute(self, out: SchedulerOutput, new_params: Mapping[int, SamplingParams],
                finished: Sequence[int]) -> StepResult:
        """Run one step. `new_params`: sampling params of sequences seen for the first time;
        `finished`: sequences whose per-request state (generators) can be dropped."""
        ...

    def shutdown(self) -> None:
        """Release ranks, process groups and ports."""
        ...

    def check_health(self) -> None:
        """Raise RankFailure if a rank is gone (cheap: an idle driver polls it)."""
        ...


class AsyncExecutor(Executor, Protocol):
    """An executor that queues a step and returns before the device has run it."""

    def launch(self, out: SchedulerOutput, new_params: Mapping[int, SamplingParams],
               finished: Sequence[int]) -> SampledTokens:
        """Queue a step; PLACEHOLDER_TOKEN decodes take the previous launch's tokens."""
        ...

    def resolve(self, sampled: SampledTokens) -> StepResult:
        """Wait for a launched step's tokens."""
        ...


class PipelinedExecutor(Executor, Protocol):
    """An executor that takes up to `max_in_flight` steps before the oldest one returns."""

    max_in_flight: int

    def submit(self, out: SchedulerOutput, new_params: Mapping[int, SamplingParams],
               finished: Sequence[int]) -> None:
        """Start a step; its sequences are disjoint from every step still in flight."""
        ...

    def collect(self) -> StepResult:
        """The result of the oldest step in flight."""
        ...


def resolve_device(name: str) -> torch.device:
    """'auto' picks CUDA when present."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is visible: allowed are auto, cpu")
    return torch.device(name)


def resolve_dtype(name: str, arch: ModelArch, device: torch.device) -> torch.dtype:
    """'auto' computes in float32 on CPU and in the checkpoint's dtype on GPU."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else DTYPES[arch.dtype]
    return DTYPES[name]


class StepSampler:
    """Sampling with per-sequence generators: a seeded request gives the same tokens
    whatever else shares its batch, and across preemptions."""

    def __init__(self, device: torch.device, engine_seed: int) -> None:
        self.device, self.engine_seed = device, engine_seed
        self.sampler = Sampler()
        self.params: dict[int, SamplingParams] = {}
        self.generators: dict[int, torch.Generator | None] = {}

    def track(self, new_params: Mapping[int, SamplingParams], finished: Sequence[int]) -> None:
        """Start tracking new sequences; forget finished ones."""
        for seq_id in finished:
            self.params.pop(seq_id, None)
            self.generators.pop(seq_id, None)
        for seq_id, p in new_params.items():
            self.params[seq_id] = p
            gen = None
            if not p.greedy:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(p.seed if p.seed is not None
                                else hash((self.engine_seed, seq_id)) & (2**63 - 1))
            self.generators[seq_id] = gen

    def sample(self, logits: torch.Tensor, seq_ids: list[int]) -> StepResult:
        """One token per row of `logits` [N, V], row i belonging to seq_ids[i]."""
        return step_result(self.launch(logits, seq_ids))

    def launch(self, logits: torch.Tensor, seq_ids: list[int]) -> SampledTokens:
        """Sample on the device; the host reads the tokens when it waits for them."""
        if not seq_ids:
            return SampledTokens([], torch.empty(0, dtype=torch.long))
        params = [self.params[i] for i in seq_ids]
        tokens = self.sampler.sample_tokens(logits, params, [self.generators[i] for i in seq_ids])
        logprobs = None
        if any(p.logprobs is not None for p in params):
            def logprobs(token_ids: list[int]) -> list[Logprob | None]:
                return self.sampler.logprobs(logits.float(), params, token_ids)
        return SampledTokens(seq_ids, tokens, logprobs)


def step_result(sampled: SampledTokens) -> StepResult:
    """Wait for `sampled` and key its tokens and logprobs by sequence."""
    tokens, logprobs = sampled.wait()
    ids = sampled.seq_ids
    return StepResult(dict(zip(ids, tokens)),
                      {i: lp for i, lp in zip(ids, logprobs) if lp is not None})


class LocalExecutor:
    """The whole model in this process (one rank, no communication)."""

    def __init__(self, config: MeshConfig, model_dir: Path, arch: ModelArch, *,
                 progress: bool = True, model: LlamaForCausalLM | None = None) -> None:
        """`model`: weights already on the device in the run's dtype (a benchmark's random
        model, say) instead of loading `model_dir`'s."""
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            tune_malloc()
        self.dtype = resolve_dtype(config.model.dtype, arch, self.device)
        if model is None:
            model = load_model(model_dir, dtype=self.dtype, device=self.device,
                               progress=progress, cpu_weight_layout=config.model.cpu_weight_layout,
                               huge_pages=config.engine.cpu_huge_pages)
        ec = config.engine
        layers = model.attention_layers()
        attn = layers[0]
        block_bytes = bytes_per_block(len(layers), attn.num_kv_heads, attn.head_dim,
                                      ec.block_size, self.dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.num_blocks = num_kv_blocks(ec, block_bytes, self.device, weight_bytes)
        cache = allocate_kv_cache(len(layers), self.num_blocks, ec.block_size,
                                  attn.num_kv_heads, attn.head_dim, self.dtype, self.device,
                                  ec.cpu_huge_pages)
        self.runner = ModelRunner(model, cache, ec.block_size, self.device)
        if ec.cuda_graphs and self.device.type == "cuda" and dispatch.use_triton(self.device):
            self.runner.enable_cuda_graphs(ec.max_num_seqs,
                                           ec.max_model_len or arch.max_position_embeddings)
        if self.device.type == "cuda":  # compile the kernels now, not in the first request
            warm_up(self.runner, self.num_blocks)
        self.sampler = StepSampler(self.device, ec.seed)
        self._previous: SampledTokens | None = None

    def execute(self, out: SchedulerOutput, new_params: Mapping[int, SamplingParams],
                finished: Sequence[int]) -> StepResult:
        return self.resolve(self.launch(out, new_params, finished))

    def launch(self, out: SchedulerOutput, new_params: Mapping[int, SamplingParams],
               finished: Sequence[int]) -> SampledTokens:
        """Queue one step on the device and return without waiting for it (async
        scheduling). Placeholder tokens in `out` are fed from the previous launch."""
        self.sampler.track(new_params, finished)
        self.runner.copy_blocks(out.block_copies)
        logits, seq_ids = self.runner.execute(out.scheduled, self._previous)
        self._previous = self.sampler.launch(logits, seq_ids)
        return self._previous

    def resolve(self, sampled: SampledTokens) -> StepResult:
        """The tokens of a launched step (waits for the device)."""
        return step_result(sampled)

    def check_health(self) -> None:
        """One process: nothing can be lost."""

    def shutdown(self) -> None:
        """Nothing to release in one process."""
