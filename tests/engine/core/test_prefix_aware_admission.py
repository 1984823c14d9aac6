"""Prefix-aware admission: a waiting sequence waits for a shared prefix being computed."""

from __future__ import annotations

from meshserve.engine.config.engine_config import EngineConfig
from meshserve.engine.core.scheduler import Scheduler
from meshserve.engine.core.scheduler_output import SchedulerOutput
from meshserve.engine.core.sequence import Sequence

BS = 4
PREFIX = list(range(100, 100 + 3 * BS))
"""Three full blocks shared by the 'sharer' sequences."""


def make_scheduler(num_blocks: int = 64, **kw: object) -> Scheduler:
    return Scheduler(EngineConfig(**kw), num_blocks, 256)


def model(token_ids: list[int]) -> int:
    """A deterministic next token that depends on the whole history."""
    return (sum((i + 1) * t for i, t in enumerate(token_ids)) * 31 + 7) % 97


def sample(s: Scheduler, out: SchedulerOutput) -> dict[int, int]:
    return {x.seq_id: model(s.get(x.seq_id).token_ids[:x.start_pos + len(x.token_ids)])
            for x in out.scheduled if x.sample}


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update(out, sample(s, out))
    return out


def chunks(out: SchedulerOutput) -> list[tuple[int, int, int, bool]]:
    """(seq_id, start_pos, num_tokens, sample) of each scheduled sequence."""
    return [(x.seq_id, x.start_pos, len(x.token_ids), x.sample) for x in out.scheduled]


def run_to_end(s: Scheduler, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished():
            return
        step(s)
    raise AssertionError("did not finish")


def sharer(seq_id: int, num_unique: int = 2, max_tokens: int = 3) -> Sequence:
    unique = [200 + 10 * seq_id + k for k in range(num_unique)]
    return Sequence(seq_id, PREFIX + unique, max_tokens=max_tokens, arrival_time=float(seq_id))


def unrelated(seq_id: int) -> Sequence:
    return Sequence(seq_id, [1, 2, 3], max_tokens=3, arrival_time=float(seq_id))


def add_all(s: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
    for x in seqs:
        s.add(x)
    return seqs


def prefill_computed(seqs: list[Sequence]) -> int:
    return sum(x.num_prompt_tokens - x.num_cached_tokens for x in seqs)


def expected_outputs(seq: Sequence) -> list[int]:
    tokens = list(seq.prompt_token_ids)
    for _ in range(seq.max_tokens):
        tokens.append(model(tokens))
    return tokens[seq.num_prompt_tokens:]


def test_sharers_arriving_together_wait_for_the_first_and_hit_its_prefix() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=64)
    seqs = add_all(s, [sharer(1), sharer(2), sharer(3), sharer(4), unrelated(5)])
    assert chunks(step(s)) == [(1, 0, 14, True), (5, 0, 3, True)]
    assert s.num_waiting == 3 and s.stats().num_deferred_admissions == 3
    assert chunks(step(s)) == [(1, 14, 1, True), (5, 3, 1, True), (2, 12, 2, True),
                               (3, 12, 2, True), (4, 12, 2, True)]
    assert [x.num_cached_tokens for x in seqs] == [0, 12, 12, 12, 0]
    run_to_end(s)
    assert prefill_computed(seqs[:4]) == 3 * BS + 4 * 2
    assert all(x.output_token_ids == expected_outputs(x) for x in seqs)
    stats = s.stats()
    assert stats.num_deferred_admissions == 3 and stats.as_dict()["num_deferred_admissions"] == 3
    assert len(s.block_manager.pending) == 0


def test_a_chunked_prefill_defers_sharers_until_the_whole_shared_part_is_registered() -> None:
    """Sharers are admitted once every shared block is registered (not block by block); an
    unrelated later sequence is admitted past them meanwhile."""
    s = make_scheduler(block_size=BS, max_num_batched_tokens=5)
    seqs = add_all(s, [sharer(1), sharer(2), sharer(3), sharer(4), unrelated(5)])
    assert chunks(step(s)) == [(1, 0, 5, False)]
    bm = s.block_manager
    assert len(bm.find_cached_prefix(seqs[1])) == 1  # block 0 is registered, block 1 pending
    assert bm.pending_block_hash(seqs[1], 1) == seqs[1].block_hashes[1]
    assert chunks(step(s)) == [(1, 5, 5, False)]
    assert chunks(step(s)) == [(1, 10, 4, True), (5, 0, 1, False)]  # 2, 3, 4 deferred
    assert s.stats().num_deferred_admissions == 3 and [x.seq_id for x in s.waiting] == [2, 3, 4]
    assert chunks(step(s)) == [(1, 14, 1, True), (5, 1, 2, True), (2, 12, 2, True)]
    assert chunks(step(s)) == [(1, 15, 1, True), (2, 14, 1, True), (5, 3, 1, True),
                               (3, 12, 2, True)]
    run_to_end(s)
    assert [x.num_cached_tokens for x in seqs] == [0, 12, 12, 12, 0]
    assert prefill_computed(seqs[:4]) == 3 * BS + 4 * 2
    assert all(x.output_token_ids == expected_outputs(x) for x in seqs)


def test_a_sharer_in_flight_in_another_micro_batch_defers_the_others() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=64)
    seqs = add_all(s, [sharer(1), sharer(2), unrelated(3)])
    first = s.schedule(14)
    assert chunks(first) == [(1, 0, 14, True)]
    second = s.schedule()
    assert chunks(second) == [(3, 0, 3, True)] and s.num_deferred_admissions == 1
    s.update(first, sample(s, first))
    third = s.schedule()
    assert chunks(third) == [(1, 14, 1, True), (2, 12, 2, True)]
    s.update(second, sample(s, second))
    s.update(third, sample(s, third))
    run_to_end(s)
    assert seqs[1].num_cached_tokens == 12


def test_aborting_the_computing_sequence_releases_the_deferred_ones() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=64)
    seqs = add_all(s, [sharer(1), sharer(2), sharer(3)])
    first = s.schedule(14)
    assert chunks(s.schedule()) == [] and s.num_waiting == 2  # 2 and 3 deferred
    s.abort(1)  # while in flight: nothing of it was registered
    assert len(s.block_manager.pending) == 0
    out = s.schedule()
    assert chunks(out) == [(2, 0, 14, True)]  # 2 computes the prefix; 3 now waits for 2
    s.update(first, {})
    s.update(out, sample(s, out))
    run_to_end(s)
    assert [x.num_cached_tokens for x in seqs] == [0, 0, 12]
    assert s.stats().num_deferred_admissions == 2


def test_preempting_the_computing_sequence_drops_its_pending_blocks() -> None:
    s = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=8)
    prefix = [100, 101, 102, 103, 104, 105]
    r = Sequence(0, [1, 2], max_tokens=4, arrival_time=0.0)
    a = Sequence(1, prefix + [7], max_tokens=2, arrival_time=1.0)
    b = Sequence(2, prefix + [8], max_tokens=2, arrival_time=2.0)
    add_all(s, [r, a, b])
    first = s.schedule(5)
    assert chunks(first) == [(0, 0, 2, True), (1, 0, 3, False)]
    second = s.schedule()
    assert chunks(second) == [] and s.num_deferred_admissions == 1  # b waits for a
    s.update(first, sample(s, first))
    s.update(second, {})
    out = step(s)  # r needs a block: a, the latest arrival, is preempted
    assert out.preempted_seq_ids == [1] and len(s.block_manager.pending) == 0
    bm = s.block_manager
    assert bm.pending_block_hash(b, len(bm.find_cached_prefix(b))) is None
    run_to_end(s)
    assert b.num_cached_tokens == 6  # it waited for a's recompute and hit it
    assert all(x.output_token_ids == expected_outputs(x) for x in (r, a, b))
    assert bm.num_free_blocks == 4


def test_without_prefix_caching_sharers_are_admitted_together() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=64, enable_prefix_caching=False)
    seqs = add_all(s, [sharer(1), sharer(2), sharer(3), sharer(4)])
    assert [x[0] for x in chunks(step(s))] == [1, 2, 3, 4]
    run_to_end(s)
    assert prefill_computed(seqs) == 4 * 14 and s.stats().num_deferred_admissions == 0


def test_static_policy_defers_within_its_batch_and_keeps_late_arrivals_out() -> None:
    s = make_scheduler(block_size=BS, max_num_batched_tokens=64, policy="static",
                       static_batch_size=3)
    seqs = add_all(s, [sharer(1), sharer(2), sharer(3), sharer(4)])
    assert [x[0] for x in chunks(step(s))] == [1]
    assert [x[0] for x in chunks(step(s))] == [1, 2, 3]
    while s.get(1) or s.get(2) or s.get(3):
        assert 4 not in [x[0] for x in chunks(step(s))]
    run_to_end(s)
    assert [x.num_cached_tokens for x in seqs] == [0, 12, 12, 12]


def test_fifo_order_is_kept_when_the_head_does_not_fit() -> None:
    """A non-deferred sequence that does not fit still stops the queue behind it."""
    s = make_scheduler(block_size=BS, max_num_batched_tokens=16, enable_chunked_prefill=False)
    big = Sequence(3, list(range(300, 316)), max_tokens=1, arrival_time=3.0)
    small = Sequence(4, [1, 2], max_tokens=1, arrival_time=4.0)
    seqs = add_all(s, [sharer(1), sharer(2), big, small])
    # 2 budget tokens left: 2 is deferred, 3 does not fit, so 4 waits though it would fit
    assert [x[0] for x in chunks(step(s))] == [1]
    assert [x.seq_id for x in s.waiting] == [2, 3, 4]
    run_to_end(s)
    assert seqs[1].num_cached_tokens == 12


def test_reset_prefix_cache_passthrough() -> None:
    s = make_scheduler(block_size=BS)
    add_all(s, [sharer(1)])
    run_to_end(s)
    assert s.reset_prefix_cache() == 4  # KV of 14 prompt + 2 fed output tokens: 4 full blocks
    assert s.reset_prefix_cache() == 0
