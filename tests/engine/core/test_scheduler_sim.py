"""Simulation: the scheduler drives a fake model that reads its history through a paged KV store.

The fake model's next token depends on every earlier token, and it reads positions
< start_pos back from a dict slot -> token written through each step's slot mapping. A
wrong block table, slot, prefix-cache hit, block copy or recompute changes the outputs,
which must equal a reference computed straight from the token history. Requests often
share a prefix and arrive together, so admissions are deferred for prefixes being computed;
every request must still finish (no starvation, no deadlock).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.core.block_manager import BlockManager, NoFreeBlocksError, cdiv
from meshserve.engine.core.scheduler import Scheduler
from meshserve.engine.core.scheduler_output import PLACEHOLDER_TOKEN, SchedulerOutput
from meshserve.engine.core.sequence import Sequence, SequenceStatus

VOCAB = 24
MAX_STEPS = 5000


def next_token(history: list[int]) -> int:
    """The fake model: a rolling hash of the whole history."""
    h = 0
    for t in history:
        h = (h * 1_000_003 + t + 1) % (2**61 - 1)
    return h % VOCAB


def reference(tokens: list[int], num_outputs: int, seq: Sequence, max_model_len: int) -> list[int]:
    """Outputs of an uninterrupted run that has generated `num_outputs` of `tokens` already."""
    tokens = list(tokens)
    outputs = tokens[len(tokens) - num_outputs:]
    while True:
        t = next_token(tokens)
        tokens.append(t)
        outputs.append(t)
        if t in seq.stop_token_ids and len(outputs) >= seq.min_tokens:
            return outputs
        if len(outputs) >= seq.max_tokens or len(tokens) >= max_model_len:
            return outputs


class PagedModel:
    """Writes each fed token at its slot and samples from the history read back by slot."""

    def __init__(self, block_manager: BlockManager) -> None:
        self.bm = block_manager
        self.bs = block_manager.block_size
        self.kv: dict[int, int] = {}

    def execute(self, out: SchedulerOutput, previous: dict[int, int] | None = None
                ) -> dict[int, int]:
        """Sampled tokens by sequence; a placeholder is fed `previous`'s token for its
        sequence (async scheduling: the step before, not yet resolved)."""
        bs, kv = self.bs, self.kv
        for src, dst in out.block_copies:
            for off in range(bs):
                if src * bs + off in kv:
                    kv[dst * bs + off] = kv[src * bs + off]
        sampled = {}
        for x in out.scheduled:
            table = x.block_table
            for i, token in enumerate(x.token_ids):
                if token == PLACEHOLDER_TOKEN:
                    assert previous is not None and len(x.token_ids) == 1, x
                    token = previous[x.seq_id]
                pos = x.start_pos + i
                assert self.bm.ref_count(table[pos // bs]) == 1, "write into a shared block"
                kv[table[pos // bs] * bs + pos % bs] = token
            if x.sample:
                end = x.start_pos + len(x.token_ids)
                history = [kv[table[p // bs] * bs + p % bs] for p in range(end)]
                sampled[x.seq_id] = next_token(history)
        return sampled


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    stop_token_ids: frozenset[int]
    arrival_step: int


@dataclass
class Workload:
    config: EngineConfig
    num_blocks: int
    max_model_len: int
    requests: list[Request]
    pipeline_depth: int
    micro_budget: int | None
    events: list[tuple[int, str, int]]
    """(step, 'abort' | 'fork', which request-or-sequence index)."""
    async_scheduling: bool = False
    """Schedule step n+1 before step n is resolved (Scheduler.advance / resolve); depth 1."""


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(4, 48))
    min_prefix = draw(st.sampled_from([0, block_size, 2 * block_size]))  # often a full block
    prefixes = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=min_prefix,
                                      max_size=max(20, min_prefix)), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = draw(st.sampled_from(prefixes)) + draw(
            st.lists(st.integers(0, VOCAB - 1), max_size=10))
        prompt = (prompt or [draw(st.integers(0, VOCAB - 1))])[:max_model_len]
        max_tokens = draw(st.integers(1, 12))
        requests.append(Request(
            prompt, max_tokens, draw(st.sampled_from([0, 0, 0, max_tokens // 2])),
            frozenset(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
            draw(st.sampled_from([0, 0, 0, 1]) | st.integers(0, 8))))  # often together
    chunked = draw(st.booleans())
    budget = draw(st.integers(1, 24) | st.integers(24, 64))
    if not chunked:
        budget = max(budget, max(len(r.prompt) for r in requests))
    config = EngineConfig(
        block_size=block_size, max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
        policy=draw(st.sampled_from(["continuous", "continuous", "static"])),
        static_batch_size=draw(st.integers(1, 4)))
    needed = max(cdiv(max(len(r.prompt), min(len(r.prompt) + r.max_tokens, max_model_len) - 1),
                      block_size) for r in requests)
    num_blocks = draw(st.integers(needed, needed + 6))
    depth = draw(st.sampled_from([1, 1, 2, 3]))
    micro = draw(st.none() | st.integers(1, budget)) if chunked and depth > 1 else None
    events = draw(st.lists(st.tuples(st.integers(0, 30), st.sampled_from(["abort", "fork"]),
                                     st.integers(0, 20)), max_size=3))
    async_scheduling = depth == 1 and draw(st.booleans())
    return Workload(config, num_blocks, max_model_len, requests, depth, micro, events,
                    async_scheduling)


class Driver:
    """Runs a workload to the end with up to `pipeline_depth` steps in flight."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.s = Scheduler(w.config, w.num_blocks, w.max_model_len)
        self.model = PagedModel(self.s.block_manager)
        self.seqs: list[Sequence] = []
        self.expected: dict[int, list[int]] = {}
        self.aborted: set[int] = set()
        self.pending: deque[tuple[SchedulerOutput, dict[int, int]]] = deque()
        self.num_forks = 0

    def run(self) -> None:
        if self.w.async_scheduling:
            self._run_async()
            return
        w, s = self.w, self.s
        arrivals = sorted(enumerate(w.requests), key=lambda r: r[1].arrival_step)
        step = 0
        while arrivals or s.has_unfinished() or self.pending:
            self._begin_step(step, arrivals)
            if s.has_unfinished():
                out = s.schedule(w.micro_budget)
                self._check_step(out)
                assert out.scheduled or self.pending, "idle with nothing in flight"
                self.pending.append((out, self.model.execute(out)))
                if out.scheduled and len(self.pending) < w.pipeline_depth:
                    step += 1
                    continue
            if self.pending:
                done, sampled = self.pending.popleft()
                s.update(done, sampled)
            step += 1

    def _run_async(self) -> None:
        """The engine's async loop: schedule and launch step n+1, resolve step n, advance
        n+1; step n's sequences may be in step n+1 with placeholder tokens."""
        s = self.s
        arrivals = sorted(enumerate(self.w.requests), key=lambda r: r[1].arrival_step)
        step = 0
        while arrivals or s.has_unfinished() or self.pending:
            self._begin_step(step, arrivals)
            launched = None
            if s.has_unfinished():
                out = s.schedule()
                self._check_step(out)
                assert out.scheduled or self.pending, "idle with nothing in flight"
                previous = self.pending[0][1] if self.pending else None
                launched = (out, self.model.execute(out, previous))
            if self.pending:
                done, sampled = self.pending.popleft()
                s.resolve(done, sampled)
            if launched is not None and launched[0].scheduled:
                s.advance(launched[0])
                self.pending.append(launched)
            step += 1

    def _begin_step(self, step: int, arrivals: list[tuple[int, Request]]) -> None:
        """Add the requests arriving by `step` and run its abort and fork events."""
        assert step < MAX_STEPS, "no progress"
        while arrivals and arrivals[0][1].arrival_step <= step:
            self._add(*arrivals.pop(0))
        for when, kind, which in self.w.events:
            if when == step:
                self._event(kind, which)

    def _add(self, index: int, r: Request) -> None:
        seq = Sequence(len(self.seqs), r.prompt, max_tokens=r.max_tokens,
                       stop_token_ids=r.stop_token_ids, min_tokens=r.min_tokens,
                       arrival_time=float(index))
        self.seqs.append(seq)
        self.expected[seq.seq_id] = reference(r.prompt, 0, seq, self.w.max_model_len)
        self.s.add(seq)

    def _event(self, kind: str, which: int) -> None:
        if not self.seqs:
            return
        seq = self.seqs[which % len(self.seqs)]
        if kind == "abort":
            if self.s.abort(seq.seq_id) is not None:
                self.aborted.add(seq.seq_id)
            return
        if seq.status is not SequenceStatus.RUNNING or self.s.get(seq.seq_id) is None:
            return
        if any(seq.seq_id == x.seq_id for out, _ in self.pending for x in out.scheduled):
            return  # in flight
        try:
            child = self.s.fork(seq.seq_id, len(self.seqs))
        except NoFreeBlocksError:
            return
        self.num_forks += 1
        self.seqs.append(child)
        self.expected[child.seq_id] = reference(child.token_ids, child.num_output_tokens, child,
                                                self.w.max_model_len)

    def _check_step(self, out: SchedulerOutput) -> None:
        config, s = self.w.config, self.s
        budget = min(config.max_num_batched_tokens, self.w.micro_budget or 10**9)
        assert out.num_batched_tokens == sum(len(x.token_ids) for x in out.scheduled) <= budget
        assert s.num_running <= config.max_num_seqs + self.num_forks
        ids = [x.seq_id for x in out.scheduled]
        in_flight = {x.seq_id for o, _ in self.pending for x in o.scheduled}
        if self.w.async_scheduling:  # the step before may hand its sequences straight on
            in_flight = set()
        assert len(set(ids)) == len(ids) and not in_flight & set(ids)
        for x in out.scheduled:
            seq = s.get(x.seq_id)
            assert seq is not None and x.start_pos == seq.num_computed_tokens
            assert x.token_ids == seq.token_ids[x.start_pos:x.start_pos + len(x.token_ids)]
            assert x.sample == (x.start_pos + len(x.token_ids) == seq.num_tokens)

    def check_results(self) -> None:
        s = self.s
        for seq in self.seqs:
            assert seq.is_finished, seq
            expected = self.expected[seq.seq_id]
            if seq.seq_id in self.aborted:
                assert seq.output_token_ids == expected[:len(seq.output_token_ids)]
            else:
                assert seq.output_token_ids == expected, (seq, seq.output_token_ids, expected)
        bm = s.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
        assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
        assert s.num_waiting == s.num_running == s.num_in_flight == 0
        assert not bm.pending
        if bm.prefix_cache is None:
            assert s.stats().num_deferred_admissions == 0


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_outputs_match_an_unbatched_reference(w: Workload) -> None:
    driver = Driver(w)
    driver.run()
    driver.check_results()


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads().map(lambda w: dataclasses.replace(w, pipeline_depth=1, micro_budget=None,
                                                     async_scheduling=True)))
def test_async_scheduling_matches_the_reference(w: Workload) -> None:
    """Every step scheduled before the previous one is resolved: same outputs, no leak."""
    driver = Driver(w)
    driver.run()
    driver.check_results()


def test_prefix_sharing_preemption_and_chunking_together() -> None:
    """A fixed busy case: shared prefixes, 1-token budget slices, cache at its minimum."""
    prompt = list(range(10))
    requests = [Request(prompt + [i], 6, 0, frozenset(), i % 3) for i in range(6)]
    config = EngineConfig(block_size=2, max_num_seqs=4, max_num_batched_tokens=5,
                          enable_chunked_prefill=True, enable_prefix_caching=True)
    w = Workload(config, 9, 64, requests, 2, 3, [])
    driver = Driver(w)
    driver.run()
    driver.check_results()
    stats = driver.s.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache.num_hits > 0


def test_shared_prefixes_arriving_together_are_computed_once() -> None:
    """Twelve requests over two prefixes at step 0, pipelined micro-batches, chunked prefill."""
    prefixes = [list(range(12)), list(range(12, 24))]
    requests = [Request(prefixes[i % 2] + [i], 3, 0, frozenset(), 0) for i in range(12)]
    config = EngineConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=10,
                          enable_chunked_prefill=True, enable_prefix_caching=True)
    driver = Driver(Workload(config, 64, 64, requests, 2, 6, []))
    driver.run()
    driver.check_results()
    stats = driver.s.stats()
    assert stats.num_deferred_admissions > 0 and stats.num_preemptions == 0
    assert [s.num_cached_tokens for s in driver.seqs] == [0, 0] + [12] * 10


def test_pipelined_sequences_do_not_thrash() -> None:
    """Regression: two sequences in alternating micro-batches used to preempt each other forever."""
    config = EngineConfig(block_size=1, max_num_seqs=2, max_num_batched_tokens=1,
                          enable_prefix_caching=False)
    requests = [Request([0], n, 0, frozenset(), 0) for n in (1, 1, 1, 7, 1)]
    requests.append(Request([0] * 7, 1, 0, frozenset(), 0))
    driver = Driver(Workload(config, 7, 8, requests, 2, None, []))
    driver.run()
    driver.check_results()
