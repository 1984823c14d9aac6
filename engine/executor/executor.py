"""Executors move a scheduled step to the workers that run it and the tokens back.

The engine (scheduler, requests, detokenization) is the same for every layout, and so is
the worker (engine/worker/worker.py): `InProcessExecutor` hands each step to the one
`Worker` in this process; `DistributedExecutor` broadcasts it to tp x pp ranks, each of
which runs the same `Worker`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from meshserve.engine.config.run import Run
from meshserve.engine.core.sampling_params import SequenceSampling
from meshserve.engine.core.scheduler_output import SchedulerOutput
from meshserve.engine.worker.sampling.sampled_tokens import SampledTokens
from meshserve.engine.worker.sampling.step_sampler import StepResult, step_result
from meshserve.engine.worker.worker import StepMessage, Worker
from meshserve.kernels.host_memory import tune_malloc
from meshserve.models.llama import LlamaForCausalLM


class Executor(Protocol):
    """What the engine needs from whoever runs the model."""

    num_blocks: int
    device: torch.device

    def execute(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
                finished: Sequence[int]) -> StepResult:
        """Run one step. `new_seqs`: sampling state of sequences seen for the first time;
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

    def launch(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
               finished: Sequence[int]) -> SampledTokens:
        """Queue a step; PLACEHOLDER_TOKEN decodes take the previous launch's tokens."""
        ...

    def resolve(self, sampled: SampledTokens) -> StepResult:
        """Wait for a launched step's tokens."""
        ...


class PipelinedExecutor(Executor, Protocol):
    """An executor that takes up to `max_in_flight` steps before the oldest one returns."""

    max_in_flight: int

    def submit(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
               finished: Sequence[int]) -> None:
        """Start a step; its sequences are disjoint from every step still in flight."""
        ...

    def collect(self) -> StepResult:
        """The result of the oldest step in flight."""
        ...


def step_message(step_id: int, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
                 finished: Sequence[int]) -> StepMessage:
    """What every worker of the layout is handed for one scheduled step."""
    return StepMessage(step_id, out.scheduled, out.num_batched_tokens, out.block_copies,
                       dict(new_seqs), list(finished))


def rank_device(run: Run, local_rank: int = 0) -> torch.device:
    """This rank's device: the CPU (with malloc tuned for it), or its local rank's GPU."""
    if run.device_type == "cpu":
        tune_malloc()
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


class InProcessExecutor:
    """The one worker of a one-rank layout, in this process: no communication."""

    def __init__(self, run: Run, *, progress: bool = True,
                 model: LlamaForCausalLM | None = None) -> None:
        """`model`: weights already on the device in the run's dtype (a benchmark's random
        model, say) instead of loading the run's model directory."""
        if run.config.threads:
            torch.set_num_threads(run.config.threads)
        self.device = rank_device(run)
        self.worker = Worker(run, self.device, progress=progress, model=model)
        self.worker.allocate(self.worker.local_num_blocks())
        self.num_blocks = self.worker.num_blocks
        self._step_id = 0

    @property
    def runner(self):  # noqa: ANN201 - the worker's ModelRunner
        """The worker's model runner (benchmarks time it directly)."""
        return self.worker.runner

    def _message(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
                 finished: Sequence[int]) -> StepMessage:
        self._step_id += 1
        return step_message(self._step_id, out, new_seqs, finished)

    def execute(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
                finished: Sequence[int]) -> StepResult:
        result = self.worker.execute(self._message(out, new_seqs, finished))
        assert result is not None
        return result

    def launch(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
               finished: Sequence[int]) -> SampledTokens:
        """Queue one step on the device and return without waiting for it (async
        scheduling). Placeholder tokens in `out` are fed from the previous launch."""
        sampled = self.worker.launch(self._message(out, new_seqs, finished))
        assert sampled is not None
        return sampled

    def resolve(self, sampled: SampledTokens) -> StepResult:
        """The tokens of a launched step (waits for the device)."""
        return step_result(sampled)

    def check_health(self) -> None:
        """One process: nothing can be lost."""

    def shutdown(self) -> None:
        """Nothing to release in one process."""
