"""Step timing and step records in one place: the step loops mark phases on a clock, and
the recorder adds each finished step to the engine's timing and to its step log."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshserve.engine.core.scheduler_output import SchedulerOutput
from meshserve.engine.timing.step_log import StepLog


@dataclass
class StepTiming:
    """Where step time goes: the scheduler's own (pure Python) work vs the executor's."""

    num_steps: int = 0
    num_tokens: int = 0
    scheduler_s: float = 0.0
    """schedule() + update()."""
    execute_s: float = 0.0
    """Model forward, sampling and (multi-rank) communication."""

    def add(self, scheduler_s: float, execute_s: float, num_tokens: int) -> None:
        """Account one step."""
        self.num_steps += 1
        self.num_tokens += num_tokens
        self.scheduler_s += scheduler_s
        self.execute_s += execute_s

    @property
    def scheduler_share(self) -> float:
        """Scheduler time as a share of step time."""
        total = self.scheduler_s + self.execute_s
        return self.scheduler_s / total if total else 0.0


class StepClock:
    """One step's seconds, split between the scheduler and the executor: each mark adds
    the time since the previous mark (or `resume`) to its side."""

    __slots__ = ("comm_mark", "execute_s", "last", "scheduler_s", "start")

    def __init__(self, comm_mark: float | None) -> None:
        self.start = self.last = time.perf_counter()
        self.scheduler_s = self.execute_s = 0.0
        self.comm_mark = comm_mark
        """Communication seconds when the step started (None: not measured)."""

    def scheduled(self) -> None:
        """The time since the last mark was the scheduler's."""
        now = time.perf_counter()
        self.scheduler_s += now - self.last
        self.last = now

    def executed(self) -> None:
        """The time since the last mark was the executor's."""
        now = time.perf_counter()
        self.execute_s += now - self.last
        self.last = now

    def resume(self) -> None:
        """Start counting again (the time since the last mark was another step's)."""
        self.last = time.perf_counter()


class StepRecorder:
    """The engine's StepTiming and, when configured, its step log."""

    def __init__(self, step_log: StepLog | None,
                 stages: Callable[[], Sequence[object]] | None = None) -> None:
        """`stages`: a pipeline's ranks' cumulative stage times (StageStats), written to
        the step log every STAGES_INTERVAL_S."""
        self.timing = StepTiming()
        self.step_log = step_log
        self._stages = stages if step_log is not None else None

    def start(self, *, comm: bool = True) -> StepClock:
        """A clock for a step starting now (`comm`: note the communication counter)."""
        mark = self.step_log.comm_mark() if comm and self.step_log is not None else None
        return StepClock(mark)

    def finish(self, out: SchedulerOutput, clock: StepClock, *, since: StepClock | None = None,
               num_in_flight: int | None = None, num_accepted: int = 0,
               num_drafted: int = 0) -> float:
        """Account a step whose tokens are in: its clock goes to the timing; the step record
        takes the wall, scheduler and communication time of `since` (the engine call that
        finished it, when that is not the step's own clock). Returns that wall time."""
        self.timing.add(clock.scheduler_s, clock.execute_s, out.num_batched_tokens)
        call = since or clock
        wall_s = time.perf_counter() - call.start
        if self.step_log is not None:
            self.step_log.write(out.scheduled, wall_s=wall_s,
                                scheduler_s=call.scheduler_s, comm_mark=call.comm_mark,
                                num_in_flight=num_in_flight, num_accepted=num_accepted,
                                num_drafted=num_drafted, token_budget=out.token_budget)
            if self._stages is not None and self.step_log.stages_due():
                self.step_log.write_stages(self._stages())
        return wall_s

    def write_stages(self) -> None:
        """Write the stage times now (a run's start and end)."""
        if self._stages is not None and self.step_log is not None:
            self.step_log.write_stages(self._stages())
