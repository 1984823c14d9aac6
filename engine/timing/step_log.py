"""The engine's step records for `meshserve diagnose`: one JSON line per step, appended.

Each engine starts its records with a `{"run": {...}}` line naming the model, its dtype,
the layout, the scenario and the cluster, so `meshserve diagnose` prices the records with
the run's own model and layout without being told again.

Lines go through a 64 KiB buffer, flushed at least every FLUSH_INTERVAL_S while steps run
and on close, so a running server's file can be diagnosed as it grows (a reader may see
the last line cut short; `meshserve diagnose` skips it). Writing a record costs some
microseconds: no sync, no file-system call per step, the line formatted by hand (the
fields are StepRecord's; `meshserve diagnose` validates them when it reads).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from meshserve.engine.core.scheduler_output import ScheduledSeq
from meshserve.parallel.comm.tp_group import CommCounters
from meshserve.parallel.planner.diagnosis import COUNT_FIELDS, chunk_counts

FLUSH_INTERVAL_S = 1.0
"""Longest a written record waits in the buffer while the engine keeps stepping."""
STAGES_INTERVAL_S = 1.0
"""A pipeline's stage times are written this often (and at the start and the end): one
round trip to every rank each time, not each step."""

BUFFER_BYTES = 1 << 16


class StepLog:
    """Appends a StepRecord per engine step to a JSON-lines file."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path).expanduser()
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(p, "a", buffering=BUFFER_BYTES, encoding="utf-8")  # noqa: SIM115
        except OSError as e:
            raise ValueError(f"engine.step_log={str(path)!r}: cannot append to it ({e}); "
                             "allowed is a writable file path") from None
        self.path = p
        self.comm: CommCounters | None = None
        """What `write_run` was given."""
        self._last_flush = time.monotonic()
        self._last_stages = 0.0

    def write_run(self, run: dict[str, object], comm: CommCounters | None = None) -> None:
        """Start a run's records: the line `meshserve diagnose` takes its config from.
        `comm`: the driver's TP collective counters, when their times are real (gloo on
        CPU), which each step's comm_s is read from."""
        self.comm = comm
        self._file.write(json.dumps({"run": run}) + "\n")
        self.flush()

    def comm_mark(self) -> float | None:
        """Communication seconds so far (pass to `write` to count a step's own); None when
        the executor does not measure it."""
        return self.comm.comm_s if self.comm is not None else None

    def write(self, scheduled: Sequence[ScheduledSeq], *, wall_s: float, scheduler_s: float,
              comm_mark: float | None = None, num_in_flight: int | None = None,
              num_accepted: int = 0, num_drafted: int = 0,
              token_budget: int | None = None) -> None:
        """Record one step: the chunks it ran, its wall and scheduler seconds, the
        communication since `comm_mark`, (pp > 1) the micro-batches in the pipeline, and
        (speculative decoding) the `num_drafted` drafts verified and `num_accepted` of them
        accepted, and (an automatic step budget) the `token_budget` it gave the step."""
        counts = chunk_counts([(len(s.token_ids) - s.num_drafts, s.start_pos)
                               for s in scheduled])
        scheduler_s = min(scheduler_s, wall_s)
        line = ",".join(f'"{k}":{v}' for k, v in zip(COUNT_FIELDS, counts))
        line = f'{{{line},"wall_s":{wall_s!r},"scheduler_s":{scheduler_s!r}'
        if comm_mark is not None and self.comm is not None:
            line += f',"comm_s":{min(self.comm.comm_s - comm_mark, wall_s - scheduler_s)!r}'
        if num_in_flight is not None:
            line += f',"num_in_flight":{num_in_flight}'
        if num_drafted:
            line += f',"num_draft_tokens":{num_drafted},"num_accepted_tokens":{num_accepted}'
        if token_budget is not None:
            line += f',"token_budget":{token_budget}'
        self._file.write(line + "}\n")
        now = time.monotonic()
        if now - self._last_flush >= FLUSH_INTERVAL_S:
            self._file.flush()
            self._last_flush = now

    def stages_due(self) -> bool:
        """Whether the pipeline's stage times are due again (STAGES_INTERVAL_S)."""
        return time.monotonic() - self._last_stages >= STAGES_INTERVAL_S

    def write_stages(self, stages: Sequence[object]) -> None:
        """A line of every rank's cumulative stage times (StageStats): `meshserve
        diagnose` takes a pipeline's measured bubbles from the first and last of a run."""
        rows = [asdict(s) for s in stages]  # type: ignore[call-overload]
        self._file.write(json.dumps({"stages": rows}) + "\n")
        self._last_stages = time.monotonic()

    def flush(self) -> None:
        """Write out what is buffered (a reader then sees every record so far)."""
        self._file.flush()
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Flush and close (idempotent)."""
        if not self._file.closed:
            self._file.close()
