"""A pipelined executor without ranks: each micro-batch runs on an InProcessExecutor when it
is submitted and its result comes back oldest first, as a real pipeline does (every stage
runs micro-batches in submission order). It checks and records the engine's micro-batches."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from meshserve.engine.core.sampling_params import SequenceSampling
from meshserve.engine.core.scheduler_output import SchedulerOutput
from meshserve.engine.executor.executor import InProcessExecutor
from meshserve.engine.worker.sampling.step_sampler import StepResult


class InOrderPipeline:
    """A pipelined executor over InProcessExecutor that checks the engine's micro-batches."""

    def __init__(self, local: InProcessExecutor, max_in_flight: int) -> None:
        self.local, self.max_in_flight = local, max_in_flight
        self.num_blocks, self.device = local.num_blocks, local.device
        self._results: deque[tuple[set[int], StepResult]] = deque()
        self.in_flight: set[int] = set()
        self.batches: list[tuple[int, int]] = []
        """(tokens, micro-batches already in flight) per submit."""
        self.decodes: list[int] = []
        """Sequences of each decode-only micro-batch (drafts or not), in submission order."""

    def submit(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
               finished: Sequence[int]) -> None:
        ids = {s.seq_id for s in out.scheduled}
        assert len(ids) == len(out.scheduled)
        assert not ids & self.in_flight, "a sequence was scheduled while still in flight"
        assert len(self._results) < self.max_in_flight
        self.batches.append((out.num_batched_tokens, len(self._results)))
        if all(len(x.token_ids) == 1 + x.num_drafts for x in out.scheduled):
            self.decodes.append(len(out.scheduled))
        self.in_flight |= ids
        self._results.append((ids, self.local.execute(out, new_seqs, finished)))

    def collect(self) -> StepResult:
        ids, result = self._results.popleft()
        self.in_flight -= ids
        return result

    def execute(self, out: SchedulerOutput, new_seqs: Mapping[int, SequenceSampling],
                finished: Sequence[int]) -> StepResult:
        self.submit(out, new_seqs, finished)
        return self.collect()

    def shutdown(self) -> None:
        pass
