"""Scheduler on small hand cases: budget, chunking, priority, preemption, policies, errors."""

from __future__ import annotations

import pytest

from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.core.scheduler import Scheduler
from meshserve.engine.core.scheduler_output import SchedulerOutput
from meshserve.engine.core.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks: int = 64, max_model_len: int = 256, **kw: object) -> Scheduler:
    kw.setdefault("block_size", 4)
    return Scheduler(EngineConfig(**kw), num_blocks, max_model_len)


def seq(seq_id: int, num_prompt: int, max_tokens: int = 8, **kw: object) -> Sequence:
    first = 10 * seq_id
    return Sequence(seq_id, list(range(first, first + num_prompt)), max_tokens=max_tokens,
                    arrival_time=float(seq_id), **kw)


def model(token_ids: list[int]) -> int:
    """A deterministic next token that depends on the whole history."""
    return (sum((i + 1) * t for i, t in enumerate(token_ids)) * 31 + 7) % 97


def sample(s: Scheduler, out: SchedulerOutput) -> dict[int, int]:
    return {x.seq_id: model(s.get(x.seq_id).token_ids[:x.start_pos + len(x.token_ids)])
            for x in out.scheduled if x.sample}


def step(s: Scheduler, budget: int | None = None) -> SchedulerOutput:
    out = s.schedule(budget)
    s.update(out, sample(s, out))
    return out


def chunks(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    """(seq_id, start_pos, num_tokens, sample) of each scheduled sequence."""
    return [(x.seq_id, x.start_pos, len(x.token_ids), x.sample) for x in out.scheduled]


def run_to_end(s: Scheduler, seqs: list[Sequence], max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError("did not finish")


def test_a_sequence_with_its_kv_tail_computes_only_its_last_token() -> None:
    s = make_scheduler()
    bm = s.block_manager
    a = seq(1, 11, max_tokens=1)  # 2 full blocks and 3 tokens after them
    a.keep_tail = True
    s.add(a)
    run_to_end(s, [a])
    tail = a.kv_tail
    assert tail is not None and bm.num_used_blocks == 1
    b = Sequence(2, a.token_ids, max_tokens=3)  # the prompt and its first token
    b.kv_tail, a.kv_tail = tail, None
    s.add(b)
    out = step(s)
    assert chunks(out) == [(2, 11, 1, True)]
    assert out.scheduled[0].block_table[2] == tail and b.num_cached_tokens == 8
    run_to_end(s, [b])
    assert bm.num_used_blocks == 0


def test_chunked_prefill_boundaries_and_block_tables() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    a = seq(1, 20, max_tokens=2)
    s.add(a)
    out = step(s)
    assert chunks(out) == [(1, 0, 8, False)]
    assert out.scheduled[0].token_ids == list(range(10, 18))
    assert out.scheduled[0].block_table == [0, 1] and out.num_batched_tokens == 8
    out = step(s)
    assert chunks(out) == [(1, 8, 8, False)] and out.scheduled[0].block_table == [0, 1, 2, 3]
    out = step(s)
    assert chunks(out) == [(1, 16, 4, True)] and out.scheduled[0].block_table == [0, 1, 2, 3, 4]
    assert a.output_token_ids == [model(a.prompt_token_ids)]
    out = step(s)
    assert chunks(out) == [(1, 20, 1, True)]
    assert out.scheduled[0].token_ids == [a.output_token_ids[0]]
    assert a.status is SequenceStatus.FINISHED_LENGTH and a.finish_reason == "length"
    assert not s.has_unfinished() and s.block_manager.num_free_blocks == 64


def test_decodes_go_first_then_waiting_prompts_fill_the_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    s.add(seq(1, 3))
    step(s)
    s.add(seq(2, 10))
    s.add(seq(3, 2))
    assert chunks(step(s)) == [(1, 3, 1, True), (2, 0, 7, False)]
    # seq 2 is running now and continues its prefill before seq 3 is admitted
    assert chunks(step(s)) == [(1, 4, 1, True), (2, 7, 3, True), (3, 0, 2, True)]
    assert chunks(step(s)) == [(1, 5, 1, True), (2, 10, 1, True), (3, 2, 1, True)]


def test_token_budget_is_never_exceeded() -> None:
    s = make_scheduler(max_num_batched_tokens=5, max_num_seqs=16)
    for i in range(1, 8):
        s.add(seq(i, i + 2, max_tokens=3))
    while s.has_unfinished():
        out = step(s)
        assert 1 <= out.num_batched_tokens <= 5
        assert out.num_batched_tokens == sum(len(x.token_ids) for x in out.scheduled)


def test_without_chunking_a_prompt_waits_until_it_fits_whole() -> None:
    s = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add(seq(1, 3, max_tokens=2))
    step(s)
    s.add(seq(2, 8))
    s.add(seq(3, 1))
    assert chunks(step(s)) == [(1, 3, 1, True)]  # 7 tokens left: seq 2 waits, and so does 3
    assert s.num_waiting == 2
    assert chunks(step(s)) == [(2, 0, 8, True)]


def test_max_num_seqs_limits_running() -> None:
    s = make_scheduler(max_num_seqs=2)
    s.add(seq(1, 2, max_tokens=1))
    s.add(seq(2, 2, max_tokens=3))
    s.add(seq(3, 2, max_tokens=1))
    assert [x[0] for x in chunks(step(s))] == [1, 2]
    assert s.num_running == 1 and s.num_waiting == 1
    assert [x[0] for x in chunks(step(s))] == [2, 3]


def test_per_call_budget_is_lower_only() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    s.add(seq(1, 20))
    assert chunks(step(s, budget=3)) == [(1, 0, 3, False)]
    assert chunks(step(s, budget=100)) == [(1, 3, 8, False)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.schedule(0)


def test_preemption_evicts_the_latest_arrival_and_resume_recomputes() -> None:
    s = make_scheduler(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a, b = seq(1, 3, max_tokens=4), seq(2, 3, max_tokens=4)
    s.add(a)
    s.add(b)
    assert chunks(step(s)) == [(1, 0, 3, True), (2, 0, 3, True)]
    assert chunks(step(s)) == [(1, 3, 1, True), (2, 3, 1, True)]
    out = step(s)  # a needs a third block: b goes back to the front of waiting
    assert out.preempted_seq_ids == [2] and chunks(out) == [(1, 4, 1, True)]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.block_table == [] and b.num_preemptions == 1 and s.stats().num_preemptions == 1
    assert chunks(step(s)) == [(1, 5, 1, True)]
    assert a.is_finished
    assert chunks(step(s)) == [(2, 0, 5, True)]  # prompt + 2 outputs recomputed
    run_to_end(s, [a, b])
    ref = make_scheduler(num_blocks=64, block_size=2)
    a2, b2 = seq(1, 3, max_tokens=4), seq(2, 3, max_tokens=4)
    ref.add(a2)
    ref.add(b2)
    run_to_end(ref, [a2, b2])
    assert (a.output_token_ids, b.output_token_ids) == (a2.output_token_ids, b2.output_token_ids)
    assert s.block_manager.num_free_blocks == 4


def test_a_sequence_preempts_itself_when_the_others_are_in_flight() -> None:
    s = make_scheduler(num_blocks=3, block_size=2, enable_prefix_caching=False)
    a, b = seq(1, 3, max_tokens=3), seq(2, 2, max_tokens=3)
    s.add(a)
    s.add(b)
    step(s)  # a: blocks 0, 1; b: block 2; no block left
    first = s.schedule(1)
    assert chunks(first) == [(1, 3, 1, True)]
    second = s.schedule()  # b needs a block; a is in flight, so b itself goes
    assert second.preempted_seq_ids == [2] and chunks(second) == []
    assert b.status is SequenceStatus.WAITING and s.block_manager.num_free_blocks == 1
    s.update(first, sample(s, first))
    s.update(second, {})
    run_to_end(s, [a, b])
    assert len(b.output_token_ids) == 3 and s.block_manager.num_free_blocks == 3


def test_an_older_sequence_waits_for_an_in_flight_latest_one_instead_of_going() -> None:
    s = make_scheduler(num_blocks=4, block_size=1, enable_prefix_caching=False)
    a, b = seq(1, 2, max_tokens=3), seq(2, 1, max_tokens=3)
    s.add(a)
    step(s)  # a: blocks 0, 1
    s.add(b)
    mb1 = s.schedule(1)
    assert chunks(mb1) == [(1, 2, 1, True)]  # block 2; no budget left for b
    mb2 = s.schedule()
    assert chunks(mb2) == [(2, 0, 1, True)]  # b takes the last block
    s.update(mb1, sample(s, mb1))
    mb3 = s.schedule()  # a needs a block; the victim (b, the latest) is in flight: a waits
    assert chunks(mb3) == [] and mb3.preempted_seq_ids == []
    assert a.status is SequenceStatus.RUNNING and a.block_table == [0, 1, 2]
    s.update(mb2, sample(s, mb2))
    s.update(mb3, {})
    mb4 = s.schedule()
    assert mb4.preempted_seq_ids == [2] and chunks(mb4) == [(1, 3, 1, True)]
    s.update(mb4, sample(s, mb4))
    run_to_end(s, [a, b])
    assert s.block_manager.num_free_blocks == 4


def test_prefix_cache_hits_skip_prefill_and_are_counted() -> None:
    s = make_scheduler(block_size=4)
    shared = list(range(100, 108))
    a = Sequence(1, shared + [1, 2], max_tokens=1)
    s.add(a)
    step(s)
    b = Sequence(2, shared + [3], max_tokens=1)
    s.add(b)
    assert chunks(step(s)) == [(2, 8, 1, True)]
    assert b.num_cached_tokens == 8
    s.add(Sequence(3, [5, 6], max_tokens=1))
    step(s)
    stats = s.stats().prefix_cache
    assert (stats.num_queries, stats.num_hits, stats.num_short_prompts) == (21, 8, 1)


def test_resume_after_preemption_reuses_cached_blocks() -> None:
    s = make_scheduler(num_blocks=4, block_size=2)
    a, b = seq(1, 3, max_tokens=4), seq(2, 3, max_tokens=4)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    assert step(s).preempted_seq_ids == [2]
    # a took b's evicted tail block; b's first block is still cached
    assert chunks(step(s)) == [(1, 5, 1, True)]  # a finishes
    out = step(s)
    assert chunks(out) == [(2, 2, 3, True)]
    assert out.scheduled[0].block_table[0] == 2
    stats = s.stats().prefix_cache
    assert (stats.num_recompute_queries, stats.num_recompute_hits) == (5, 2)


def test_static_policy_admits_a_batch_and_waits_for_all_of_it() -> None:
    s = make_scheduler(policy="static", static_batch_size=2)
    s.add(seq(1, 2, max_tokens=1))
    s.add(seq(2, 2, max_tokens=3))
    s.add(seq(3, 2, max_tokens=1))
    assert [x[0] for x in chunks(step(s))] == [1, 2]
    assert [x[0] for x in chunks(step(s))] == [2]  # seq 1 is done, but 3 must wait
    assert [x[0] for x in chunks(step(s))] == [2]
    assert [x[0] for x in chunks(step(s))] == [3]
    assert not s.has_unfinished()


def test_static_batch_does_not_take_late_arrivals() -> None:
    s = make_scheduler(policy="static", static_batch_size=4)
    s.add(seq(1, 2, max_tokens=2))
    step(s)
    s.add(seq(2, 2, max_tokens=1))
    assert [x[0] for x in chunks(step(s))] == [1]
    assert [x[0] for x in chunks(step(s))] == [2]


def test_abort_frees_blocks_from_running_and_waiting() -> None:
    s = make_scheduler(num_blocks=8, max_num_seqs=1)
    a, b = seq(1, 6), seq(2, 6)
    s.add(a)
    s.add(b)
    step(s)
    assert s.block_manager.num_used_blocks == 2
    assert s.abort(1) is a and a.status is SequenceStatus.FINISHED_ABORTED
    assert a.finish_reason == "abort" and s.block_manager.num_free_blocks == 8
    assert s.abort(2) is b and s.num_waiting == 0
    assert s.abort(2) is None and s.abort(99) is None
    assert not s.has_unfinished()


def test_finish_ends_a_sequence_with_a_given_status() -> None:
    s = make_scheduler()
    a = seq(1, 3)
    s.add(a)
    step(s)
    assert s.finish(1, SequenceStatus.FINISHED_STOPPED) is a
    assert a.finish_reason == "stop" and s.num_running == 0
    with pytest.raises(ValueError, match="status"):
        s.finish(1, SequenceStatus.RUNNING)


def test_stop_tokens_respect_min_tokens_and_max_model_len_ends_a_sequence() -> None:
    s = make_scheduler(max_model_len=7)
    prompt = [1, 2, 3]
    first = model(prompt)
    a = Sequence(1, prompt, max_tokens=5, stop_token_ids={first})
    b = Sequence(2, prompt, max_tokens=5, stop_token_ids={first}, min_tokens=2)
    c = Sequence(3, [4, 5, 6, 7, 8], max_tokens=5)
    for x in (a, b, c):
        s.add(x)
    run_to_end(s, [a, b, c])
    assert a.output_token_ids == [first] and a.status is SequenceStatus.FINISHED_STOPPED
    assert len(b.output_token_ids) >= 2
    assert c.num_tokens == 7 and c.status is SequenceStatus.FINISHED_LENGTH


def test_bad_requests_raise_value_errors_naming_the_field() -> None:
    s = make_scheduler(num_blocks=4, max_model_len=20)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        s.add(Sequence(1, [], max_tokens=1))
    with pytest.raises(ValueError, match="prompt_token_ids.*max_model_len"):
        s.add(Sequence(1, [1] * 21, max_tokens=1))
    with pytest.raises(ValueError, match="prompt_token_ids.*KV cache"):
        s.add(Sequence(1, [1] * 17, max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        s.add(Sequence(1, [1] * 10, max_tokens=8))  # 17 tokens of KV > 16
    s.add(Sequence(1, [1] * 10, max_tokens=7))
    with pytest.raises(ValueError, match="seq_id"):
        s.add(Sequence(1, [1], max_tokens=1))
    off = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="prompt_token_ids.*max_num_batched_tokens"):
        off.add(Sequence(1, [1] * 9, max_tokens=1))
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(EngineConfig(), 4, 0)


def test_in_flight_sequences_are_not_scheduled_again() -> None:
    s = make_scheduler(max_num_batched_tokens=8)
    for i in (1, 2, 3):
        s.add(seq(i, 3))
    first = s.schedule(3)
    assert chunks(first) == [(1, 0, 3, True)]
    second = s.schedule(3)
    assert chunks(second) == [(2, 0, 3, True)]
    third = s.schedule()
    assert chunks(third) == [(3, 0, 3, True)]
    assert chunks(s.schedule()) == [] and s.num_in_flight == 3
    s.update(second, sample(s, second))
    assert chunks(s.schedule()) == [(2, 3, 1, True)]
    s.update(first, sample(s, first))
    s.update(third, sample(s, third))
    assert s.num_in_flight == 1


def test_sequences_finished_while_in_flight_are_skipped_on_update() -> None:
    s = make_scheduler()
    s.add(seq(1, 3))
    out = s.schedule()
    s.abort(1)
    assert s.update(out, sample_any(out)) == []
    assert s.num_in_flight == 0 and s.block_manager.num_used_blocks == 0


def sample_any(out: SchedulerOutput) -> dict[int, int]:
    return {x.seq_id: 0 for x in out.scheduled if x.sample}


def test_update_returns_the_sequences_that_finished() -> None:
    s = make_scheduler()
    a, b = seq(1, 3, max_tokens=1), seq(2, 3, max_tokens=2)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert s.update(out, sample(s, out)) == [a]
    assert s.running == [b]


def test_fork_shares_blocks_and_emits_the_block_copy() -> None:
    s = make_scheduler(block_size=4)
    a = seq(1, 6, max_tokens=3)
    s.add(a)
    step(s)  # 6 computed: block 0 full, block 1 partial
    child = s.fork(1, 7)
    assert child.block_table[0] == a.block_table[0] and child.block_table[1] != a.block_table[1]
    out = s.schedule()
    assert out.block_copies == [(a.block_table[1], child.block_table[1])]
    assert chunks(out) == [(1, 6, 1, True), (7, 6, 1, True)]
    s.update(out, sample(s, out))
    assert child.output_token_ids == a.output_token_ids
    with pytest.raises(ValueError, match="child_seq_id"):
        s.fork(1, 7)
    run_to_end(s, [a, child])
    assert s.block_manager.num_free_blocks == 64


def test_scheduler_stats_snapshot() -> None:
    s = make_scheduler(num_blocks=10)
    s.add(seq(1, 5))
    s.add(seq(2, 5))
    step(s)
    stats = s.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_used_blocks) == (2, 0, 4)
    assert stats.as_dict()["num_free_blocks"] == 6
