"""The one worker type: a rank's share of the model (every layer when it runs alone), its
paged KV cache, its sampler where it samples, CUDA graphs and warm-up.

Every rank runs a `Worker`, whatever the layout: the in-process executor holds one, a
multi-rank driver holds one and so does every other rank. Executors only move
`StepMessage`s to workers and `StepResult`s back. A step through a worker whose stage holds
every layer goes through the ModelRunner (CUDA graphs where they are captured, async
feeds); a pipeline stage receives activations, runs its layers and passes them on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from meshserve.engine.config.run import (
    Run,
    async_scheduling,
    compute_dtype,
    cpu_bf16_batches,
    cpu_weights,
    kv_cache_dtype,
)
from meshserve.engine.core.sampling_params import SequenceSampling
from meshserve.engine.core.scheduler_output import PLACEHOLDER_TOKEN, ScheduledSeq
from meshserve.engine.worker.draft_proposer import DraftProposer
from meshserve.engine.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_kv_blocks
from meshserve.engine.worker.model_runner import ModelRunner
from meshserve.engine.worker.sampling.grammar import make_grammars
from meshserve.engine.worker.sampling.prompt_logprobs import split_logits
from meshserve.engine.worker.sampling.sampled_tokens import SampledTokens
from meshserve.engine.worker.sampling.step_sampler import StepResult, StepSampler, step_result
from meshserve.engine.worker.step_inputs import PromptRows, build_step_inputs
from meshserve.engine.worker.warmup import warm_up
from meshserve.kernels import dispatch
from meshserve.models.llama import LayerHook, LlamaForCausalLM
from meshserve.models.loader import load_model
from meshserve.parallel.comm.mesh import ProcessGroups
from meshserve.parallel.comm.p2p import StageLink, TensorChannel
from meshserve.parallel.comm.ranks import RankFailure, failure_reason
from meshserve.parallel.comm.tp_group import SINGLE
from meshserve.parallel.planner.search import lm_head_split


@dataclass(slots=True)
class StepMessage:
    """One step (a micro-batch under a pipeline) as an executor hands it to the workers."""

    step_id: int
    scheduled: list[ScheduledSeq]
    num_tokens: int
    """Tokens fed this step: the rows of the activations passed between stages."""
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    new_seqs: dict[int, SequenceSampling] = field(default_factory=dict)
    finished: list[int] = field(default_factory=list)
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    """A pipeline with a draft model: the driver's drafts fill `scheduled`, and a sampled
    request's draft distributions [n, vocab] (on the host) travel here to the sampler."""


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


@dataclass(frozen=True, slots=True)
class _Awaited:
    """What the driver of a split LM head samples of a micro-batch in flight."""

    seq_ids: list[int]
    drafts: dict[int, list[int]]
    draft_probs: dict[int, torch.Tensor]
    prompt: PromptRows | None = None
    """Rows after the sampled ones that score prompt tokens."""


def _drafts_of(scheduled: list[ScheduledSeq]) -> dict[int, list[int]]:
    """Each speculating sequence's drafts in a step."""
    return {s.seq_id: s.drafts for s in scheduled if s.num_drafts}


class Worker:
    """This rank's layers of the model, their KV cache and (where it samples) the samplers.

    `groups` is None for a rank that runs alone. `allocate(num_blocks)` follows once every
    rank of the replica agreed on the count (`local_num_blocks()` is this rank's share)."""

    def __init__(self, run: Run, device: torch.device, *, groups: ProcessGroups | None = None,
                 layer_range: tuple[int, int] | None = None, max_in_flight: int = 1,
                 progress: bool = False, model: LlamaForCausalLM | None = None) -> None:
        """`model`: weights already on the device in the run's dtype (a benchmark's random
        model, say) instead of loading the run's model directory."""
        self.run, self.groups, self.device = run, groups, device
        self.layer_range = layer_range or (0, run.arch.num_hidden_layers)
        """The global layers this rank's stage holds, [start, stop)."""
        self.dtype = compute_dtype(run)
        self.kv_dtype = kv_cache_dtype(run)
        arch, ec = run.arch, run.config.engine
        self.head_split = lm_head_split(run.config, arch.vocab_size, device.type)
        self.model = model or load_model(
            run.model_dir, dtype=self.dtype, tp=groups.tp if groups else SINGLE,
            layer_range=layer_range, device=device, progress=progress,
            cpu_weight_layout=run.config.model.cpu_weight_layout, head_split=self.head_split,
            cpu_weight_dtype=cpu_weights(run), bf16_batches=cpu_bf16_batches(run),
            huge_pages=ec.cpu_huge_pages, arch=arch)
        self.hidden_size, self.vocab_size = arch.hidden_size, arch.vocab_size
        self.is_first_stage = groups is None or groups.is_first_stage
        self.is_last_stage = groups is None or groups.is_last_stage
        self.link = self._stage_link(max_in_flight) if groups is not None else None
        samples = groups is None or groups.is_sampler
        self.sampler = StepSampler(device, ec.seed, arch.vocab_size,
                                   grammars=lambda: make_grammars(run)) if samples else None
        drafts = run.config.speculative.method == "draft"
        # A pipeline drafts on its driver (stage 0 feeds the drafts) before the step
        # leaves it; a whole model drafts where it samples.
        drafts_here = (samples and self.whole_model if groups is None or groups.dims.pp == 1
                       else groups.rank == groups.driver_rank)
        self.drafter = (DraftProposer(run, device, self.dtype) if drafts and drafts_here
                        else None)
        """speculative.method=draft: the draft model (the sampling rank, or a pipeline's
        driver)."""
        # A TP group: the driver drafts and every rank feeds its drafts to the target.
        self._share_drafts = (drafts and self.whole_model and groups is not None
                              and groups.tp.size > 1)
        # Split head: the last stage's rows and logits go to the driver, which samples.
        self.logits = self._logits_channel(max_in_flight) if groups is not None else None
        # Driver of a split head: what it samples of each micro-batch in flight, and the
        # sequences to forget once the micro-batches before them are sampled.
        self._awaiting: deque[_Awaited] = deque()
        self._to_forget: deque[tuple[int, list[int]]] = deque()
        self._num_sampled = 0  # micro-batches sampled by collect_sampled()
        self.runner: ModelRunner | None = None
        self.num_blocks = 0
        self._previous: SampledTokens | None = None
        # Async scheduling in a TP group: the driver samples, and every rank feeds the
        # next step's placeholder tokens from the tokens it broadcasts.
        self._share_tokens = (groups is not None and groups.tp.size > 1 and self.whole_model
                              and async_scheduling(run))
        self._busy_s = self._input_wait_s = 0.0
        self._num_micro_batches = 0

    @property
    def whole_model(self) -> bool:
        """Whether this stage holds every layer and the whole LM head (no pipeline)."""
        return self.is_first_stage and self.is_last_stage and self.head_split is None

    def _stage_link(self, max_in_flight: int) -> StageLink:
        g = self.groups
        assert g is not None
        rank, pp = g.rank, g.dims.pp
        prev = g.stage_rank(g.pp_rank - 1) if g.pp_rank > 0 else None
        nxt = g.stage_rank(g.pp_rank + 1) if g.pp_rank < pp - 1 else None
        return StageLink(g.pp_group, prev, nxt, max_pending=max_in_flight + 1,
                         timeout=g.op_timeout,
                         ring_in=g.rings.get(("act", prev, rank)) if prev is not None else None,
                         ring_out=g.rings.get(("act", rank, nxt)) if nxt is not None else None,
                         watch=g.watch)

    def _logits_channel(self, max_in_flight: int) -> TensorChannel | None:
        g = self.groups
        assert g is not None
        if self.head_split is None or g.rank not in (g.driver_rank, g.last_stage_rank):
            return None
        src, dst = g.last_stage_rank, g.driver_rank
        peer = dst if g.rank == src else src
        return TensorChannel(g.result_group, peer, 2 * (max_in_flight + 1), g.op_timeout,
                             ring=g.rings.get(("result", src, dst)), alive=g.watch(peer))

    def stats(self) -> StageStats:
        """This rank's time so far."""
        g = self.groups
        rank, pp_rank, tp_rank = (g.rank, g.pp_rank, g.tp_rank) if g else (0, 0, 0)
        return StageStats(rank, pp_rank, tp_rank, self._busy_s, self._input_wait_s,
                          self._num_micro_batches)

    def observe_layers(self, hook: LayerHook) -> None:
        """Call `hook(global layer index, tokens in the step)` after each of this rank's
        layers runs (enqueued, on a GPU)."""
        self.model.observe_layers(hook)

    def local_num_blocks(self) -> int:
        """KV blocks this rank's memory budget holds for its layers."""
        layers = self.model.attention_layers()
        attn = layers[0]
        block_bytes = bytes_per_block(len(layers), attn.num_kv_heads, attn.head_dim,
                                      self.run.config.engine.block_size, self.kv_dtype)
        weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.drafter is not None:  # its cache has as many blocks as the target's
            block_bytes += self.drafter.block_bytes()
            weight_bytes += self.drafter.weight_bytes()
        return num_kv_blocks(self.run.config.engine, block_bytes, self.device, weight_bytes)

    def allocate(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks (the same count on every rank) for this stage;
        on a GPU capture the decode graphs (a stage holding every layer) and warm up."""
        ec = self.run.config.engine
        layers = self.model.attention_layers()
        attn = layers[0]
        cache = allocate_kv_cache(len(layers), num_blocks, ec.block_size, attn.num_kv_heads,
                                  attn.head_dim, self.kv_dtype, self.device, ec.cpu_huge_pages)
        self.runner = ModelRunner(self.model, cache, ec.block_size, self.device)
        self.num_blocks = num_blocks
        runners = [self.runner]
        if self.drafter is not None:
            self.drafter.allocate(num_blocks)
            assert self.drafter.runner is not None
            runners.append(self.drafter.runner)
        if self.device.type != "cuda":
            return
        max_len = ec.max_model_len or self.run.arch.max_position_embeddings
        for runner in runners:
            whole = self.whole_model or runner is not self.runner  # a draft model is
            if ec.cuda_graphs and whole and dispatch.use_triton(self.device):
                runner.enable_cuda_graphs(ec.max_num_seqs, max_len)
            if whole:  # compile the kernels now, not in the first request
                warm_up(runner, num_blocks)

    @torch.inference_mode()
    def execute(self, msg: StepMessage) -> StepResult | None:
        """Run this rank's part of a step: a whole model's forward and sampling, or a
        stage's (receive activations, run the layers, pass them on or sample). The
        sampling rank returns the tokens, the others None."""
        t0 = time.perf_counter()
        waited = 0.0
        try:
            if self.whole_model:
                sampled = self._launch(msg)
                result = step_result(sampled) if sampled is not None else None
            else:
                result, waited = self._run_stage(msg)
        finally:
            self._account(t0, waited)
        return result

    @torch.inference_mode()
    def launch(self, msg: StepMessage) -> SampledTokens:
        """(A stage holding every layer, on the sampling rank) Queue the step on the device
        and return without waiting for it: placeholder decode tokens are fed from the
        previous launch's samples, which may still be on the device (async scheduling)."""
        assert self.sampler is not None, "launch() runs on the sampling rank"
        t0 = time.perf_counter()
        try:
            sampled = self._launch(msg)
            assert sampled is not None
            return sampled
        finally:
            self._account(t0, 0.0)

    def _account(self, t0: float, waited: float) -> None:
        self._busy_s += time.perf_counter() - t0 - waited
        self._input_wait_s += waited
        self._num_micro_batches += 1

    def _launch(self, msg: StepMessage) -> SampledTokens | None:
        """The whole model's step, sampled on the device (None on a rank that does not
        sample); on a TP group under async scheduling every rank ends with the driver's
        tokens for the next step's feeds."""
        runner = self.runner
        assert runner is not None and self.whole_model, "allocate() first, whole model only"
        if self.sampler is not None:
            self.sampler.track(msg.new_seqs, msg.finished)
        runner.copy_blocks(msg.block_copies)
        scheduled, draft_probs = msg.scheduled, None
        if self.drafter is not None:
            self.drafter.track(msg.new_seqs, msg.finished)
            self.drafter.copy_blocks(msg.block_copies)
            made = self.drafter.propose(scheduled)
            scheduled, draft_probs = made.scheduled, made.probs
        if self._share_drafts:
            scheduled = self._shared_drafts(msg.scheduled, scheduled)
        step = runner.run_step(scheduled, self._previous)
        logits, seq_ids = step.logits, step.seq_ids
        if self.sampler is not None:
            assert logits is not None  # (a sampler lives where the LM head is)
            drafts = _drafts_of(scheduled)
            sampled: SampledTokens | None = self.sampler.launch(logits, seq_ids, drafts,
                                                                draft_probs, step.prompt)
        elif self._share_tokens:  # the driver's tokens arrive below
            sampled = SampledTokens(seq_ids, torch.empty(len(seq_ids), dtype=torch.long,
                                                         device=self.device))
        else:  # nothing here feeds from them
            return None
        if self._share_tokens and seq_ids:
            assert self.groups is not None and sampled is not None
            self.groups.tp.broadcast(sampled.tokens, src=0)
        self._previous = sampled
        return sampled

    def _shared_drafts(self, reserved: list[ScheduledSeq],
                       filled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """The TP driver's drafts on every rank of the group: `reserved`, the step as
        scheduled; `filled`, the driver's with its drafts (returned as it is there; the
        other ranks build theirs). The drafts travel in the reserved slots, a run that
        ended early padded with PLACEHOLDER_TOKEN."""
        n = sum(s.num_drafts for s in reserved)
        if not n:
            return filled
        assert self.groups is not None
        driver = self.drafter is not None
        if driver:
            flat = torch.tensor([t for r, s in zip(reserved, filled) if r.num_drafts
                                 for t in [*s.drafts,
                                           *[PLACEHOLDER_TOKEN] * (r.num_drafts - s.num_drafts)]],
                                device=self.device)
        else:
            flat = torch.empty(n, dtype=torch.long, device=self.device)
        self.groups.tp.broadcast(flat, src=0)
        if driver:
            return filled
        tokens, out, at = flat.tolist(), [], 0
        for s in reserved:
            if s.num_drafts:
                drafts = [t for t in tokens[at:at + s.num_drafts] if t != PLACEHOLDER_TOKEN]
                at += s.num_drafts
                s = replace(s, token_ids=[*s.token_ids[:-s.num_drafts], *drafts],
                            num_drafts=len(drafts))
            out.append(s)
        return out

    @torch.inference_mode()
    def fill_drafts(self, msg: StepMessage) -> StepMessage:
        """(A pipeline's driver, method=draft) The step with the draft model's drafts in
        its reserved slots and its rows counted again (a run that ended early fills
        fewer), before it goes to the other ranks: every stage then runs the same rows,
        and the sampler verifies them against the distributions in `draft_probs`."""
        drafter = self.drafter
        assert drafter is not None and not self.whole_model, "a pipeline's driver drafts here"
        t0 = time.perf_counter()
        try:
            drafter.track(msg.new_seqs, msg.finished)
            drafter.copy_blocks(msg.block_copies)
            made = drafter.propose(msg.scheduled)
        finally:
            self._busy_s += time.perf_counter() - t0
        return replace(msg, scheduled=made.scheduled,
                       num_tokens=sum(len(s.token_ids) for s in made.scheduled),
                       draft_probs={i: p.to("cpu", copy=True)  # its own storage, pickled
                                    for i, p in made.probs.items()})

    def _run_stage(self, msg: StepMessage) -> tuple[StepResult | None, float]:
        """A pipeline stage's part of the step and the seconds it waited for activations."""
        runner, link = self.runner, self.link
        assert runner is not None and link is not None, "allocate() first"
        waited = 0.0
        if self.sampler is not None:
            self.sampler.track(msg.new_seqs, self._forget_when_sampled(msg.finished))
        runner.copy_blocks(msg.block_copies)
        inputs = build_step_inputs(msg.scheduled, runner.block_size, self.device)
        hidden = residual = None
        if not self.is_first_stage:
            t0 = time.perf_counter()
            try:
                hidden, residual = link.recv(msg.num_tokens, self.hidden_size, self.dtype,
                                             self.device)
                waited = time.perf_counter() - t0
            except RuntimeError as e:
                assert self.groups is not None
                prev = self.groups.describe(link.prev_rank)
                raise RankFailure(f"no activations from {prev}: {failure_reason(e)}") from e
        hidden, residual = self.model(inputs.input_ids, inputs.positions, inputs.meta,
                                      hidden, residual)
        drafts = _drafts_of(msg.scheduled)
        if not self.is_last_stage:
            assert residual is not None
            link.send(hidden, residual)
            if self.logits is not None:  # the driver of a split head: collect_sampled() next
                self._awaiting.append(_Awaited(inputs.sample_seq_ids, drafts, msg.draft_probs,
                                               inputs.prompt))
            return None, waited
        if self.logits is not None:  # the last stage of a split head: rows, then logits, on
            if inputs.num_logit_rows:  # (the driver's part runs while this one does)
                rows = inputs.logit_rows(hidden)
                self.logits.send([rows])
                part = self.model.compute_logits(rows)
                assert part is not None
                self.logits.send([part])
            return None, waited
        if not inputs.num_logit_rows:
            return (StepResult() if self.sampler is not None else None), waited
        step = split_logits(self.model.compute_logits(inputs.logit_rows(hidden)),
                            inputs.sample_seq_ids, inputs.prompt)
        if self.sampler is None:
            return None, waited
        assert step.logits is not None
        return self.sampler.sample(step.logits, step.seq_ids, drafts,
                                   self._on_device(msg.draft_probs), step.prompt), waited

    def _on_device(self, probs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {i: p.to(self.device) for i, p in probs.items()}

    @torch.inference_mode()
    def collect_sampled(self) -> StepResult:
        """(Driver of a split LM head) Tokens of the oldest micro-batch in flight: the last
        stage's normed rows arrive, this stage computes its part of the logits (while the
        last stage computes the other part), adds the last stage's part and samples.
        Waiting for either counts as input wait, the rest as busy."""
        assert self.logits is not None and self.sampler is not None and self._awaiting
        awaited = self._awaiting.popleft()
        try:
            return self._sample_awaited(awaited)
        finally:
            self._forget_sampled()

    def _sample_awaited(self, awaited: _Awaited) -> StepResult:
        seq_ids, prompt = awaited.seq_ids, awaited.prompt
        n = len(seq_ids) + (prompt.num_rows if prompt is not None else 0)
        if not n:
            return StepResult()
        assert self.head_split is not None
        t0 = time.perf_counter()
        assert self.logits is not None and self.sampler is not None
        rows = self.logits.recv((n, self.hidden_size), self.dtype, self.device)
        t1 = time.perf_counter()
        first = self.model.compute_logits(rows)
        assert first is not None
        t2 = time.perf_counter()
        part = self.logits.recv((n, self.vocab_size - self.head_split), self.dtype,
                                self.device)
        t3 = time.perf_counter()
        step = split_logits(torch.cat([first, part], dim=-1), seq_ids, prompt)
        assert step.logits is not None
        result = self.sampler.sample(step.logits, seq_ids, awaited.drafts,
                                     self._on_device(awaited.draft_probs), step.prompt)
        self._input_wait_s += (t1 - t0) + (t3 - t2)
        self._busy_s += (t2 - t1) + (time.perf_counter() - t3)
        return result

    def _forget_when_sampled(self, finished: list[int]) -> list[int]:
        """The finished sequences the sampler may forget now: all of them, except on the
        driver of a split head, where micro-batches still in flight may hold them (an
        abort) and are sampled here later: those wait for them (`_forget_sampled`)."""
        if self.logits is None or self.is_last_stage or not self._awaiting or not finished:
            return finished
        self._to_forget.append((self._num_sampled + len(self._awaiting), finished))
        return []

    def _forget_sampled(self) -> None:
        """A micro-batch was sampled: forget the sequences nothing in flight holds now."""
        assert self.sampler is not None
        self._num_sampled += 1
        while self._to_forget and self._to_forget[0][0] <= self._num_sampled:
            self.sampler.track({}, self._to_forget.popleft()[1])

    def drain(self) -> None:
        """Wait until the next stage took every activation this rank sent (and the driver
        every logits message)."""
        if self.link is not None:
            self.link.drain()
        g = self.groups
        if self.logits is not None and g is not None and g.rank == g.last_stage_rank:
            self.logits.drain()
