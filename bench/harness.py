"""Run meshserve over a workload through the step-level Engine, honouring arrival times."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol

from meshserve.bench.metrics import RequestRecord, RunResult
from meshserve.bench.peer_names import MESHSERVE
from meshserve.bench.roofline import kv_bytes_per_token, weight_bytes_read
from meshserve.bench.workloads import BenchRequest
from meshserve.engine.config.run import compute_dtype
from meshserve.engine.config.runtime_config import RuntimeConfig
from meshserve.engine.core.outputs import RequestOutput
from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.engine import Engine
from meshserve.engine.executor.distributed_executor import DistributedExecutor
from meshserve.engine.llm import LLM
from meshserve.engine.worker.worker import StageStats

OnFinish = Callable[[], None]
"""Called once per completed request (drives the progress bar)."""


class Runner(Protocol):
    """An engine the benchmark can run a workload on."""

    name: str

    def run(self, reqs: list[BenchRequest], on_finish: OnFinish | None = None) -> RunResult:
        """Run every request to completion; records in the workload's order."""
        ...


@dataclass
class _DecodeSteps:
    """Steps in which every running sequence decodes (no prefill, nothing waiting)."""

    seconds: list[float] = field(default_factory=list)
    bytes_read: float = 0.0
    num_seqs: int = 0

    def add(self, seconds: float, num_seqs: int, bytes_read: float) -> None:
        """Record one step."""
        self.seconds.append(seconds)
        self.num_seqs += num_seqs
        self.bytes_read += bytes_read

    def as_dict(self) -> dict[str, float]:
        """Totals for MBU (bytes_read / time_s / bandwidth) and the typical step."""
        total = sum(self.seconds)
        n = len(self.seconds)
        return {"num_steps": n, "time_s": total, "bytes_read": self.bytes_read,
                "median_step_s": statistics.median(self.seconds) if n else float("nan"),
                "mean_batch": self.num_seqs / n if n else float("nan")}


class MeshserveRunner:
    """meshserve's LLM/Engine on one process; the prefix cache is emptied before each run."""

    def __init__(self, config: RuntimeConfig, name: str = MESHSERVE) -> None:
        self.name = name
        self.llm = LLM(config=config, progress=False)
        engine = self.llm.engine
        self.dtype = compute_dtype(engine.run)
        """The compute dtype (the peers run in it too)."""
        itemsize = self.dtype.itemsize
        self._weight_bytes = weight_bytes_read(engine.arch, itemsize)
        self._kv_bytes_per_token = kv_bytes_per_token(engine.arch, itemsize)

    def run(self, reqs: list[BenchRequest], on_finish: OnFinish | None = None) -> RunResult:
        """Submit each request when its arrival comes; step until all are done."""
        engine = self.llm.engine
        assert not engine.has_unfinished(), "a previous run left requests behind"
        # Each run starts cold: a cache warm from the previous run would turn every
        # prompt into a hit and measure nothing.
        engine.reset_prefix_cache()
        before = engine.stats.prefix_cache
        ranks_before = self._stage_stats()
        state = _RunState(reqs, time.monotonic())
        while len(state.done) < len(reqs):
            self._submit_due(state)
            if engine.has_unfinished():
                self._step(state, on_finish)
            else:  # idle until the next arrival
                time.sleep(max(0.0, state.next_arrival() - time.monotonic()))
        ranks_after = self._stage_stats()
        records = [_record(state.done[i], state.t0) for i in range(len(reqs))]
        for i, rid in ((i, state.done[i].request_id) for i in range(len(reqs))):
            records[i].itl = state.gaps.get(rid, [])
        wall = max(r.finish for r in records) - min(r.arrival for r in records)
        after = engine.stats.prefix_cache
        recompute = ((after.num_recompute_queries - before.num_recompute_queries)
                     - (after.num_recompute_hits - before.num_recompute_hits))
        prompt_computed = sum(r.num_prompt_tokens - r.num_cached_tokens for r in records)
        extra = {"prefill_tokens_computed": prompt_computed + recompute,
                 "recompute_tokens": recompute,
                 "prefix_cache_hits": after.num_hits - before.num_hits,
                 "prefix_cache_queries": after.num_queries - before.num_queries,
                 "decode_steps": state.steps.as_dict()}
        if ranks_before is not None and ranks_after is not None:
            extra["ranks"] = [asdict(a.minus(b)) for a, b in zip(ranks_after, ranks_before)]
        return RunResult(self.name, records, wall, extra)

    def _stage_stats(self) -> list[StageStats] | None:
        """Each rank's busy time so far (multi-rank runs), else None."""
        engine = self.llm.engine
        if not isinstance(engine, Engine):  # replicas: their ranks' times stay with them
            return None
        executor = engine.executor
        return executor.stage_stats() if isinstance(executor, DistributedExecutor) else None

    def _submit_due(self, state: _RunState) -> None:
        """Add the requests whose arrival time has come, stamped with that time."""
        now = time.monotonic()
        while state.nxt < len(state.order) and state.next_arrival() <= now:
            i = state.order[state.nxt]
            r = state.reqs[i]
            rid = self.llm.engine.add_request(r.prompt_token_ids, _greedy(r.max_new_tokens),
                                              arrival_time=state.t0 + r.arrival_s)
            state.index_of[rid] = i
            state.active[rid] = len(r.prompt_token_ids)
            state.nxt += 1

    def _step(self, state: _RunState, on_finish: OnFinish | None) -> None:
        """One engine step; a decode-only step is timed with the bytes it must read."""
        engine = self.llm.engine
        # Only one engine's step is one forward; a data-parallel front's step returns as
        # soon as any replica has sent something, so timing it would measure nothing.
        decode_only = (isinstance(engine, Engine) and state.started.issuperset(state.active)
                       and engine.stats.num_waiting == 0)
        context = sum(state.active.values()) if decode_only else 0
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        if decode_only and outs:
            state.steps.add(dt, len(state.active),
                            self._weight_bytes + self._kv_bytes_per_token * context)
        now = time.monotonic()
        for out in outs:
            if out.request_id in state.started and out.new_token_ids:
                state.gaps.setdefault(out.request_id, []).append(
                    now - state.last_token[out.request_id])
            if out.new_token_ids:
                state.last_token[out.request_id] = now
            state.started.add(out.request_id)
            state.active[out.request_id] = len(out.prompt_token_ids) + len(out.token_ids)
            if out.finished:
                state.done[state.index_of[out.request_id]] = out
                del state.active[out.request_id]
                if on_finish:
                    on_finish()


class _RunState:
    """Book-keeping of one run: submissions, requests in flight, outputs, decode steps."""

    def __init__(self, reqs: list[BenchRequest], t0: float) -> None:
        self.reqs = reqs
        self.t0 = t0
        self.order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
        self.nxt = 0
        """Position in `order` of the next request to submit."""
        self.index_of: dict[str, int] = {}
        self.active: dict[str, int] = {}
        """Unfinished request id -> prompt + generated tokens (its KV to read)."""
        self.started: set[str] = set()
        """Requests with a first token (past their prefill)."""
        self.done: dict[int, RequestOutput] = {}
        self.steps = _DecodeSteps()
        self.last_token: dict[str, float] = {}
        """Request id -> when its latest tokens came."""
        self.gaps: dict[str, list[float]] = {}
        """Request id -> the seconds between each of its token-bearing outputs and the one
        before (its inter-token latencies)."""

    def next_arrival(self) -> float:
        """Monotonic time of the next submission."""
        return self.t0 + self.reqs[self.order[self.nxt]].arrival_s


def _greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def _record(out: RequestOutput, t0: float) -> RequestRecord:
    m = out.metrics
    assert m.finish_time is not None
    return RequestRecord(
        arrival=m.arrival_time - t0,
        first_token=None if m.first_token_time is None else m.first_token_time - t0,
        finish=m.finish_time - t0, num_prompt_tokens=m.num_prompt_tokens,
        num_generated_tokens=len(out.token_ids), token_ids=list(out.token_ids),
        num_cached_tokens=m.num_cached_tokens, num_preemptions=m.num_preemptions)
