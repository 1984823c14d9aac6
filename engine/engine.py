"""The step-level engine: requests in, one scheduled forward pass per step, outputs out."""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from meshserve.engine.client import COLOCATED, ReplicaState
from meshserve.engine.config.run import Run, async_scheduling, resolve_run
from meshserve.engine.config.runtime_config import RuntimeConfig
from meshserve.engine.core.micro_batch import micro_batch_budget, micro_batch_cap
from meshserve.engine.core.outputs import RequestMetrics, RequestOutput
from meshserve.engine.core.sampling_params import SamplingParams, SequenceSampling
from meshserve.engine.core.scheduler import Scheduler
from meshserve.engine.core.scheduler_output import SchedulerOutput, SchedulerStats
from meshserve.engine.core.sequence import Sequence, SequenceStatus
from meshserve.engine.core.step_budget import StepBudget
from meshserve.engine.core.stop_strings import StopStrings
from meshserve.engine.executor.executor import (
    AsyncExecutor,
    Executor,
    InProcessExecutor,
    PipelinedExecutor,
)
from meshserve.engine.timing.speculation_prior import speculation_prior
from meshserve.engine.timing.step_budget_prior import step_time_prior
from meshserve.engine.timing.step_clock import StepClock, StepRecorder, StepTiming
from meshserve.engine.timing.step_log import StepLog
from meshserve.engine.worker.sampling.grammar import compiler_for
from meshserve.engine.worker.sampling.prompt_logprobs import PromptChunk
from meshserve.engine.worker.sampling.sampled_tokens import Logprob, SampledTokens
from meshserve.engine.worker.sampling.step_sampler import StepResult
from meshserve.models.tokenizer import IncrementalDetokenizer, Tokenizer
from meshserve.parallel.comm.ranks import RankFailure
from meshserve.parallel.comm.tp_group import CommCounters
from meshserve.parallel.planner.diagnosis import chunk_counts

__all__ = ["Engine", "StepTiming", "make_executor"]


@dataclass
class _Request:
    request_id: str
    seq: Sequence
    params: SamplingParams
    metrics: RequestMetrics
    detok: IncrementalDetokenizer | None
    stops: StopStrings
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """Asked for: per prompt token (None for the first) its log-prob and the top k's."""
    num_emitted: int = 0
    """Output tokens already returned in a RequestOutput."""


class Engine:
    """Continuous batching over a paged KV cache on one rank."""

    def __init__(self, run: Run | RuntimeConfig, *, progress: bool = True,
                 executor: Executor | None = None) -> None:
        """`run`: the resolved run (a RuntimeConfig is resolved here); `executor`: one
        already built for it, instead of the layout's own."""
        self.run = run if isinstance(run, Run) else resolve_run(run)
        self.model_dir, self.arch = self.run.model_dir, self.run.arch
        self.config = config = self.run.config
        self.tokenizer = (Tokenizer(self.model_dir)
                          if (self.model_dir / "tokenizer.json").is_file() else None)
        self.max_model_len = self._max_model_len()
        wants_async = async_scheduling(self.run)  # a bad setting fails before ranks start
        # Opened before any rank starts, so a bad path fails at once.
        self.step_log = StepLog(config.engine.step_log) if config.engine.step_log else None
        self.executor: Executor = executor or make_executor(self.run, progress=progress)
        self._max_in_flight: int = getattr(self.executor, "max_in_flight", 1)
        # Micro-batches in the pipeline (pp > 1), oldest first, with their clocks.
        self._in_flight: deque[tuple[SchedulerOutput, StepClock]] = deque()
        self.device = self.executor.device
        self._micro_batch_cap = micro_batch_cap(config.engine.step_token_cap,
                                                self._max_in_flight, self.device.type,
                                                config.parallel.micro_batch_tokens)
        self.async_scheduling = self._async_scheduling(wants_async)
        # Async scheduling: the step launched last, not yet resolved, with its clock.
        self._launched: tuple[SchedulerOutput, SampledTokens, StepClock] | None = None
        self.num_blocks = self.executor.num_blocks
        budget = (StepBudget(config.scenario.tpot_slo_ms / 1e3, config.engine.step_token_cap,
                             step_time_prior(self.run))
                  if config.engine.auto_step_budget else None)
        spec = config.speculative
        switched = spec.enabled and spec.max_batch_size is None
        self.scheduler = Scheduler(
            config.engine, self.num_blocks, self.max_model_len, self.arch.sliding_window,
            spec, budget, switch_prior=speculation_prior(self.run) if switched else None,
            # a pipeline times a probe only among its kind
            switch_probe_length=self._max_in_flight + 1 if self._max_in_flight > 1 else 1)
        self._new_seqs: dict[int, SequenceSampling] = {}
        stages = getattr(self.executor, "stage_stats", None)  # a pipeline's stage times
        self.recorder = StepRecorder(self.step_log,
                                     stages if self.run.config.parallel.pp > 1 else None)
        self.timing = self.recorder.timing
        self._finished: list[int] = []
        self.eos_token_ids = set(self.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self._requests: dict[int, _Request] = {}
        self._by_request_id: dict[str, int] = {}
        self._launch_hooks: list[Callable[[SchedulerOutput], None]] = []
        """Called with each step as it is scheduled, before it runs (not on a pipeline): a
        prefill replica pins the blocks a streamed prompt's step completes."""
        self._seq_ids = itertools.count()
        if self.step_log is not None:
            self.step_log.write_run(self._run_header(), self._measured_comm())
            self.recorder.write_stages()

    def _async_scheduling(self, wanted: bool) -> bool:
        """async_scheduling(run) where the executor can launch a step without waiting and
        keeps one step in flight (a pipeline keeps its own)."""
        able = hasattr(self.executor, "launch") and self._max_in_flight == 1
        if wanted and not able and self.config.engine.async_scheduling:
            raise ValueError("engine.async_scheduling=true needs an executor that launches "
                             f"one step at a time (this one is {type(self.executor).__name__},"
                             f" {self._max_in_flight} steps in flight): allowed are null, false")
        return wanted and able

    def _run_header(self) -> dict[str, object]:
        """What `meshserve diagnose` needs to price this run's step records."""
        c = self.config
        # A bundled model is named, a directory given is recorded (and named by it).
        path = str(self.model_dir) if c.model.path else None
        return {"model_name": c.model.name, "model_path": path,
                "dtype": c.model.dtype, "tp": c.parallel.tp, "pp": c.parallel.pp,
                "dp": c.parallel.dp, "scenario": c.scenario.name, "cluster": c.cluster.name,
                "tpot_slo_ms": c.scenario.tpot_slo_ms}

    def _measured_comm(self) -> CommCounters | None:
        """The driver's TP collective counters when their times are real: gloo on CPU."""
        if self.device.type != "cpu" or self.config.parallel.tp == 1:
            return None
        return getattr(self.executor, "comm_counters", None)

    def _max_model_len(self) -> int:
        limit = self.arch.max_position_embeddings
        asked = self.config.engine.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"engine.max_model_len={asked} exceeds the model's "
                             f"max_position_embeddings: allowed is at most {limit}")
        return asked or limit

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt."""
        if self.tokenizer is None:
            raise ValueError(f"prompt: {self.model_dir} has no tokenizer.json, so prompts must "
                             "be token-id lists")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Bad input raises ValueError naming the field."""
        ids, params = self.validate(prompt, params)
        seq_id = next(self._seq_ids)
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self._by_request_id:
            raise ValueError(f"request_id={request_id!r} is already in use: allowed is a new id")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        now = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(seq_id, ids, max_tokens=params.max_tokens, stop_token_ids=stop_ids,
                       min_tokens=params.min_tokens, arrival_time=now)
        seq.speculate = self.config.speculative.enabled and _may_speculate(params)
        seq.scores_prompt = params.prompt_logprobs is not None
        self.scheduler.add(seq)
        self._new_seqs[seq_id] = SequenceSampling(
            params, tuple(ids) if params.repetition_penalty != 1.0 else ())
        detok = IncrementalDetokenizer(self.tokenizer, ids) if self.tokenizer else None
        self._requests[seq_id] = _Request(request_id, seq, params,
                                          RequestMetrics(now, num_prompt_tokens=len(ids)), detok,
                                          StopStrings(params.stop),
                                          prompt_logprobs=[None] * len(ids)
                                          if seq.scores_prompt else None)
        self._by_request_id[request_id] = seq_id
        return request_id

    def validate(self, prompt: str | list[int], params: SamplingParams | None
                 ) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the params (defaults if None); ValueError naming the
        field for anything this engine does not take."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: got {type(params).__name__}, "
                             "allowed is a SamplingParams")
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_prompt(ids)
        vocab = self.arch.vocab_size
        bad = [t for t, _ in params.logit_bias_items if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias: token ids {bad[:5]} outside the vocabulary; allowed "
                             f"are ints in [0, {vocab})")
        if params.structured_outputs is not None:  # a grammar that cannot compile fails here
            compiler_for(self.run)[0].compile(params.structured_outputs)  # (and is cached)
        return ids, params

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt: empty; allowed is at least one token")
        vocab = self.arch.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary; allowed are "
                             f"ints in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens; allowed is fewer than "
                             f"max_model_len={self.max_model_len}")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if it is unknown or already done."""
        seq_id = self._by_request_id.get(request_id)
        if seq_id is None:
            return False
        self.scheduler.abort(seq_id)
        req = self._requests.pop(seq_id)
        del self._by_request_id[request_id]
        req.seq.set_finished(SequenceStatus.FINISHED_ABORTED)
        self._forget(seq_id)
        return True

    def wake(self) -> None:
        """Cut short a step() waiting for other replicas: this engine steps in the caller's
        thread and never waits, so there is nothing to cut short."""

    def observe_launches(self, hook: Callable[[SchedulerOutput], None]) -> None:
        """Call `hook` with each step as it is scheduled, before it runs (not on a
        pipeline, whose steps run elsewhere)."""
        self._launch_hooks.append(hook)

    def check_health(self) -> None:
        """Raise RankFailure if a rank has died (an idle engine sees it without a step)."""
        self.executor.check_health()

    def reset_prefix_cache(self) -> int:
        """Uncache every unused cached KV block (e.g. between benchmark runs); return how many."""
        return self.scheduler.reset_prefix_cache()

    def sequence(self, request_id: str) -> Sequence | None:
        """The request's sequence while it is here (a replica's KV hand-off reads its
        blocks and marks its prompt's partial last block: engine/replicas/kv_handoff.py)."""
        seq_id = self._by_request_id.get(request_id)
        return None if seq_id is None else self._requests[seq_id].seq

    def _forget(self, seq_id: int) -> None:
        """Tell the executor (at the next step) that this sequence's state can go."""
        if self._new_seqs.pop(seq_id, None) is None:
            self._finished.append(seq_id)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, or a micro-batch is in the pipeline."""
        return (self.scheduler.has_unfinished() or bool(self._in_flight)
                or self._launched is not None)

    def shutdown(self) -> None:
        """Release the executor's ranks, process groups and ports; close the step log."""
        if self.step_log is not None:
            try:
                self.recorder.write_stages()  # the run's last stage times
            except RankFailure:
                pass  # a rank is gone: the last line written stands
            self.step_log.close()
        self.executor.shutdown()

    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass; outputs of the requests it advanced."""
        if self._max_in_flight > 1:
            return self._step_pipelined()
        if self.async_scheduling:
            if self.scheduler.speculative is not None and self.scheduler.plan_drafting():
                # Drafts need every token before them: finish the step in flight first.
                drained = self._resolve_launched(self.recorder.start(comm=False), timed=False)
                return drained + self._step_sync()
            return self._step_async()
        return self._step_sync()

    def _step_sync(self) -> list[RequestOutput]:
        """Schedule, run and apply one step, waiting for it."""
        clock = self.recorder.start()
        t0 = time.perf_counter()  # drafting costs the scheduler's proposals too
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        for hook in self._launch_hooks:
            hook(out)
        new = self._admit_to_executor(out)
        clock.scheduled()
        result = self.executor.execute(out, new, self._take_finished())
        clock.executed()
        self.scheduler.update(out, result.tokens, result.accepted, result.num_drafted)
        if self.scheduler.switch is not None:
            self._observe_speculation(out, time.perf_counter() - t0,
                                      plain=not self.async_scheduling)
        clock.scheduled()
        wall_s = self.recorder.finish(
            out, clock, num_in_flight=1 if self.config.parallel.pp > 1 else None,
            num_accepted=sum(len(a) for a in result.accepted.values()),
            num_drafted=sum(result.num_drafted.values()))
        self._observe_budget(out, wall_s)
        return self._outputs(result)

    def _observe_budget(self, out: SchedulerOutput, seconds: float) -> None:
        """Tell an automatic step budget what the step's work cost."""
        budget = self.scheduler.step_budget
        if budget is None:
            return
        prefill, _, _, decodes, context = chunk_counts(
            (len(s.token_ids) - s.num_drafts, s.start_pos) for s in out.scheduled)
        budget.observe(decodes, context, prefill, seconds)

    def _observe_speculation(self, out: SchedulerOutput, seconds: float, *,
                             plain: bool = True) -> None:
        """Tell the switch what a decode-only step (drafts or not) cost; `plain`: whether
        a step without drafts counts (not one waited for under async scheduling)."""
        if not _decode_only(out):
            return  # a prompt chunk's cost is no decode's
        drafted = _drafted(out)
        if not drafted and not plain:
            return  # plain steps are timed as async scheduling runs them, not waited for
        lag = sum(len(s.draft_context) for s in out.scheduled if s.draft_context is not None)
        switch = self.scheduler.switch
        assert switch is not None
        # Lagging a token after a fully accepted run is steady drafting; more is catch-up.
        switch.observe(out.num_running, drafted, seconds, caught_up=lag > out.num_seqs)

    def _step_async(self) -> list[RequestOutput]:
        """Schedule and launch the next step, then resolve the one launched before it:
        the host's scheduling, input building and launching overlap the device's work.
        Returns the outputs of the resolved step."""
        executor = cast(AsyncExecutor, self.executor)
        call = self.recorder.start(comm=False)
        clock = self.recorder.start(comm=False)
        out = self.scheduler.schedule()
        clock.scheduled()
        launched = None
        if out.scheduled:
            for hook in self._launch_hooks:
                hook(out)
            launched = executor.launch(out, self._admit_to_executor(out), self._take_finished())
            clock.executed()
        outputs = self._resolve_launched(call)
        if launched is not None:
            self.scheduler.advance(out)
            self._launched = (out, launched, clock)
        return outputs

    def _resolve_launched(self, call: StepClock, *, timed: bool = True) -> list[RequestOutput]:
        """Wait for the step launched last (if any) and apply its tokens; its step record
        takes `call`'s wall time (in steady state, one step's). `timed`: whether that
        time prices steps (not when `call` only waited for the step's end)."""
        if self._launched is None:
            return []
        executor = cast(AsyncExecutor, self.executor)
        done, sampled, done_clock = self._launched
        self._launched = None
        done_clock.resume()
        result = executor.resolve(sampled)
        done_clock.executed()
        self.scheduler.resolve(done, result.tokens)
        outputs = self._outputs(result)
        done_clock.scheduled()
        call.scheduler_s = done_clock.scheduler_s  # its record: this call's wall time
        wall_s = self.recorder.finish(done, done_clock, since=call)
        if timed:
            self._observe_budget(done, wall_s)
            if self.scheduler.switch is not None:  # a plain step as async scheduling runs it
                self._observe_speculation(done, wall_s)
        return outputs

    def _step_pipelined(self) -> list[RequestOutput]:
        """Fill the pipeline with micro-batches (disjoint sequences, balanced by tokens),
        then finish the oldest; outputs of the requests it advanced."""
        executor = cast(PipelinedExecutor, self.executor)
        call = self.recorder.start()  # the step record: this call's wall and scheduling
        self._fill_pipeline(executor, call)
        if not self._in_flight:
            return []
        out, clock = self._in_flight.popleft()
        clock.resume()
        result = executor.collect()
        clock.executed()
        before_update = clock.scheduler_s
        self.scheduler.update(out, result.tokens, result.accepted, result.num_drafted)
        clock.scheduled()
        call.scheduler_s += clock.scheduler_s - before_update
        wall_s = self.recorder.finish(
            out, clock, since=call, num_in_flight=len(self._in_flight) + 1,
            num_accepted=sum(len(a) for a in result.accepted.values()),
            num_drafted=sum(result.num_drafted.values()))
        if self.scheduler.switch is not None and all(
                _decode_only(o) and _drafted(o) == _drafted(out) for o, _ in self._in_flight):
            # A pipeline returns a micro-batch per call: while the ones beside it are decode
            # steps of its kind (the call ran the next one's stage 0), the call's wall time
            # is what one costs on the slowest stage.
            self._observe_speculation(out, wall_s)
        return self._outputs(result)

    def _fill_pipeline(self, executor: PipelinedExecutor, call: StepClock) -> None:
        """Submit micro-batches until the pipeline holds `max_in_flight` or nothing is left
        to schedule; their scheduling counts in `call`'s scheduler time."""
        while len(self._in_flight) < self._max_in_flight:
            clock = self.recorder.start(comm=False)
            drafting = (self.scheduler.speculative is not None
                        and self.scheduler.plan_drafting())
            out = self.scheduler.schedule(self._micro_batch_budget(drafting),
                                          hold_draft_slots=drafting)
            new = self._admit_to_executor(out) if out.scheduled else {}
            clock.scheduled()
            call.scheduler_s += clock.scheduler_s
            if not out.scheduled:
                break
            executor.submit(out, new, self._take_finished())
            clock.executed()
            self._in_flight.append((out, clock))

    def _take_finished(self) -> list[int]:
        """Sequences the executor may forget, handed over once."""
        finished, self._finished = self._finished, []
        return finished

    def _outputs(self, result: StepResult) -> list[RequestOutput]:
        """The outputs of a step's tokens (a request that ended meanwhile is gone)."""
        now = time.monotonic()
        requests = self._requests
        for seq_id, chunk in result.prompt_logprobs.items():
            if seq_id in requests:
                _record_prompt_logprobs(requests[seq_id], chunk)
        return [self._advance(requests[i], t, result.logprobs.get(i), now)
                for i, t in result.tokens.items() if i in requests]

    def _admit_to_executor(self, out: SchedulerOutput) -> dict[int, SequenceSampling]:
        """Stamp first-scheduled times; the sampling state of sequences the executor
        sees for the first time."""
        now = time.monotonic()
        for s in out.scheduled:
            m = self._requests[s.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
        return {s.seq_id: self._new_seqs.pop(s.seq_id) for s in out.scheduled
                if s.seq_id in self._new_seqs}

    def _micro_batch_budget(self, drafting: bool = False) -> int:
        """An even share, over the pipeline's slots, of the tokens the next micro-batches
        will run: those that could run now (running sequences not in flight, waiting ones
        as far as free KV blocks go) and those the micro-batches in flight will bring
        back (a decode each, or the rest of a prompt). Counting the latter keeps the
        sequence groups that alternate through the pipeline the same size as sequences
        finish: a group grown larger leaves its youngest to the next micro-batch.
        `drafting`: the next micro-batch carries drafts, so a speculating sequence's
        decode counts its speculative.num_tokens draft slots too."""
        sched = self.scheduler
        k = sched.speculative.num_tokens if drafting and sched.speculative is not None else 0
        in_flight: set[int] = set()
        returning = 0
        for out, _ in self._in_flight:
            for x in out.scheduled:
                in_flight.add(x.seq_id)
                seq = sched.get(x.seq_id)
                if seq is not None:  # not finished or aborted meanwhile
                    returning += (1 + k * seq.speculate if x.sample
                                  else seq.num_tokens - x.start_pos - len(x.token_ids))
        pending = sum(s.num_tokens - s.num_computed_tokens
                      + (k * s.speculate if s.num_tokens - s.num_computed_tokens == 1 else 0)
                      for s in sched.running if s.seq_id not in in_flight)
        if sched.waiting:
            bm = sched.block_manager
            pending += min(sum(s.num_tokens for s in sched.waiting),
                           bm.num_free_blocks * bm.block_size)
        return micro_batch_budget(pending, returning, self._max_in_flight,
                                  self._micro_batch_cap)

    def _advance(self, req: _Request, token: int,
                 logprob: Logprob | None, now: float) -> RequestOutput:
        """The request's output after a step that gave it `token` (a speculating step may
        have given it several: every output token not yet returned is new)."""
        seq, m = req.seq, req.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        new = seq.output_token_ids[req.num_emitted:] if seq.num_draft_tokens else [token]
        m.num_preemptions = seq.num_preemptions
        if logprob is not None:
            req.logprobs.append(logprob)
        delta = ""
        for j, t in enumerate(new):
            last = j == len(new) - 1
            piece = req.detok.add(t) if req.detok else ""
            if last and seq.is_finished and req.detok:
                piece += req.detok.flush()
            delta += req.stops.add(piece, final=last and seq.is_finished)
            if req.stops.stopped:  # a stop string in the last token still reads as a stop
                if not last:  # ... or in an accepted draft: cut there
                    seq.truncate_output(req.num_emitted + j + 1)
                    new = new[:j + 1]
                if seq.is_finished:
                    seq.set_finished(SequenceStatus.FINISHED_STOPPED)
                else:
                    self.scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
                break
        req.num_emitted = seq.num_output_tokens
        m.num_generated_tokens = seq.num_output_tokens
        m.num_cached_tokens = seq.num_cached_tokens
        m.num_draft_tokens = seq.num_draft_tokens
        m.num_accepted_tokens = seq.num_accepted_tokens
        if seq.is_finished:
            m.finish_time = now
            self._requests.pop(seq.seq_id, None)
            self._by_request_id.pop(req.request_id, None)
            self._forget(seq.seq_id)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=req.stops.released, new_token_ids=new,
            new_text=delta, finished=seq.is_finished, finish_reason=seq.finish_reason,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=req.prompt_logprobs, metrics=m)

    @property
    def stats(self) -> SchedulerStats:
        """Scheduler and cache counters (for logs and metrics)."""
        return self.scheduler.stats()

    def replica_states(self) -> list[ReplicaState]:
        """This engine as the one replica of its run (for /health and metrics)."""
        return [ReplicaState(0, COLOCATED, self.num_blocks, self.stats)]


def _record_prompt_logprobs(req: _Request, chunk: PromptChunk) -> None:
    """Keep a scored chunk's entries: each prompt token's log-prob first, then the top k's
    at its position (a recompute writes the same positions again)."""
    assert req.prompt_logprobs is not None, req.request_id
    start, entries = chunk
    prompt = req.seq.prompt_token_ids
    for pos, (lp, top) in enumerate(entries, start):
        mapping = {prompt[pos]: lp}
        for token, value in top:
            mapping.setdefault(token, value)
        req.prompt_logprobs[pos] = mapping


def _drafted(out: SchedulerOutput) -> bool:
    """Whether a step carries drafts."""
    return any(s.num_drafts for s in out.scheduled)


def _decode_only(out: SchedulerOutput) -> bool:
    """Whether every sequence of a step decodes (with drafts or not): no prompt chunk."""
    return all(s.sample and len(s.token_ids) == 1 + s.num_drafts for s in out.scheduled)


def _may_speculate(params: SamplingParams) -> bool:
    """Whether a request's decodes may carry drafts: not while it asks for logprobs, a
    penalty, a logit bias or a grammar (those read each position's own history), nor a
    seeded sampled one (whether a step drafts depends on its batch, and a seed promises
    the same output whatever the batch): such requests decode plainly in the same steps.
    Greedy output is the same either way."""
    return (params.logprobs is None and not params.penalized and not params.logit_bias
            and params.structured_outputs is None
            and (params.greedy or params.seed is None))


def make_executor(run: Run, *, progress: bool = True) -> Executor:
    """This process's one worker for a one-rank layout, else the driver of tp x pp ranks."""
    env = run.env
    if run.world_size == 1 and (env is None or env.world_size == 1):
        return InProcessExecutor(run, progress=progress)
    from meshserve.engine.executor.distributed_executor import DistributedExecutor

    return DistributedExecutor(run, progress=progress)
