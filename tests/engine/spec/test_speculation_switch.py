"""The run-time switch: drafts where a drafted step's expected tokens per second (from
each request's accepted drafts per verify) beat a plain step's at this batch size, times
measured as the run goes; each side timed again now and then."""

from __future__ import annotations

from meshserve.engine.config.run import resolve_run
from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.engine.spec.speculation_switch import (
    MARGIN,
    MAX_CATCH_UP,
    MAX_PROBE_EVERY,
    PROBE_EVERY,
    SpeculationSwitch,
)
from meshserve.engine.timing.speculation_prior import speculation_prior


def run(switch: SpeculationSwitch, accepted: list[float | None], steps: int,
        drafted_s: float, plain_s: float, lag: int = 0) -> list[bool]:
    choices = []
    for _ in range(steps):
        draft = switch.allow(accepted, lag)
        choices.append(draft)
        switch.observe(len(accepted), draft, drafted_s if draft else plain_s)
    return choices


def test_it_drafts_where_the_expected_tokens_pay_for_the_step_and_probes_the_other() -> None:
    s = SpeculationSwitch()
    # 2 accepted drafts per verify: a drafted step emits 3 tokens for 2.5x the time.
    small = run(s, [2.0], 200, drafted_s=0.0075, plain_s=0.003)
    assert small[:2] == [True, False]  # each side timed once
    assert sum(small[2:]) > 0.9 * len(small[2:])  # then drafting
    assert 0 < small[2:].count(False) <= len(small) // PROBE_EVERY + 1  # plain probed
    # 64 sequences: the same acceptance no longer pays for a drafted step 3.2x as long.
    large = run(s, [2.0] * 64, 200, drafted_s=0.032, plain_s=0.01)
    assert sum(large[2:]) <= len(large) // PROBE_EVERY + 1
    assert s.num_drafted_steps + s.num_plain_steps == 400


def test_requests_that_would_not_draft_count_one_token() -> None:
    assert SpeculationSwitch.gain([3.0, None]) == 2.5
    s = SpeculationSwitch()
    # Half the batch paused: 2.5 tokens per sequence for 2.6x the time does not pay.
    choices = run(s, [3.0, None], 100, drafted_s=0.026, plain_s=0.01)
    assert sum(choices[2:]) <= 100 // PROBE_EVERY + 1
    assert SpeculationSwitch.gain([3.0, 3.0]) * 0.01 >= MARGIN * 0.026  # and all of it does


def test_a_cold_first_step_weighs_no_more_than_the_next_ones() -> None:
    s = SpeculationSwitch()
    s.observe(1, True, 0.05)  # the first drafted step pays one-time costs
    for _ in range(3):
        s.observe(1, True, 0.006)
    s.observe(1, False, 0.003)
    drafted, plain = s.step_seconds(1)
    assert drafted is not None and drafted < 0.02 and plain == 0.003  # a mean of the first
    for _ in range(8):
        s.observe(1, True, 0.006)
    drafted, _ = s.step_seconds(1)
    assert drafted is not None and drafted < 0.008  # then a running average: it fades
    assert s.allow([2.0])


def test_it_follows_a_change_of_machine_load() -> None:
    s = SpeculationSwitch()
    run(s, [1.0], 100, drafted_s=0.007, plain_s=0.003)  # 2 tokens for 2.3x: close
    after = run(s, [1.0], 300, drafted_s=0.004, plain_s=0.003)
    assert sum(after[-100:]) > 90


def test_drafting_far_behind_is_not_probed_and_untimed_buckets_take_the_prior() -> None:
    s = SpeculationSwitch(prior=lambda n: 1.5 if n < 8 else 6.0)
    big = run(s, [2.0] * 64, 300, drafted_s=0.2, plain_s=0.03)
    assert not any(big)  # priced at half of plain: never drafted, not even to time it
    small = run(s, [2.0], 100, drafted_s=0.0045, plain_s=0.003)
    assert small[0] is False and all(small[1:30])  # plain timed, the prior says draft


def test_the_cost_model_prior_grows_with_the_batch_and_the_draft_model() -> None:
    def prior(method: str):
        run = resolve_run(load_runtime_config(["model=meshcoder", "parallel=single",
                                               f"speculative={method}"]), env=None,
                          announce=False)
        return speculation_prior(run)

    ngram, draft = prior("ngram"), prior("draft")
    assert ngram is not None and draft is not None and prior("none") is None
    for n in (1, 4, 16, 64):
        assert 1.0 <= ngram(n) < draft(n)  # a verify is never cheaper than a decode
    assert ngram(1) < ngram(8) < ngram(64)  # more rows cost more as the batch grows


def test_a_step_that_caught_the_draft_up_is_not_timed_and_the_next_one_is() -> None:
    s = SpeculationSwitch()
    assert s.allow([2.0])
    s.observe(1, True, 0.05, caught_up=True)  # the draft model ran a whole prompt too
    assert s.step_seconds(1) == (None, None) and s.allow([2.0])
    s.observe(1, True, 0.006)
    assert s.step_seconds(1) == (0.006, None)


def test_a_timed_bucket_prices_an_untimed_one_scaled_by_the_prior() -> None:
    s = SpeculationSwitch(prior=lambda n: 1.0 + n / 8)
    run(s, [2.0], 10, drafted_s=0.0045, plain_s=0.003)  # batch 1: timed, ratio 1.5
    # batch 64 (prior 9 against 1.125 at batch 1): priced at 12x plain, far behind
    big = run(s, [2.0] * 64, 100, drafted_s=0.1, plain_s=0.01)
    assert not any(big)


def test_a_price_set_in_a_slow_spell_is_probed_again_where_catching_up_is_cheap() -> None:
    s = SpeculationSwitch()
    run(s, [2.0], 200, drafted_s=0.012, plain_s=0.003)  # a slow spell: 3 tokens for 4x
    # Priced far behind: no probe for MAX_PROBE_EVERY steps, none at all while the draft
    # model would have more than MAX_CATCH_UP tokens to catch up on.
    assert not any(run(s, [2.0], MAX_PROBE_EVERY + 10, drafted_s=0.006, plain_s=0.003,
                       lag=MAX_CATCH_UP + 1))
    after = run(s, [2.0], 2 * MAX_PROBE_EVERY, drafted_s=0.006, plain_s=0.003, lag=100)
    first = after.index(True)
    assert first <= MAX_PROBE_EVERY  # probed: 3 tokens for 2x now, and the old times go
    assert sum(after[first:]) > 0.9 * len(after[first:])


def test_a_neighbours_ratio_without_a_prior_is_timed_here_before_it_rules_drafting_out() -> None:
    s = SpeculationSwitch()  # no cost model for this device
    # Six sequences: drafting measured at 3x a plain step for 1.76 tokens, far behind.
    run(s, [0.76] * 6, 40, drafted_s=0.003, plain_s=0.001)
    # One sequence: nothing timed here; the carried ratio alone must not keep drafting
    # untimed for good (here a drafted step costs 1.2x a plain one for 1.76 tokens).
    alone = run(s, [0.76], 4 * PROBE_EVERY, drafted_s=0.0012, plain_s=0.001)
    assert alone[0] is False  # plain timed first
    first = alone.index(True)
    assert first <= PROBE_EVERY + 1
    assert sum(alone[first:]) > 0.9 * len(alone[first:])  # timed, it pays: drafting holds


def test_a_smaller_batch_that_priced_drafting_out_rules_out_larger_ones_unprobed() -> None:
    s = SpeculationSwitch()  # no cost model for this device
    # Four sequences: drafting timed (more than three times) at 6x a plain step for 2.4
    # tokens: far behind.
    run(s, [1.4] * 4, 4 * PROBE_EVERY, drafted_s=0.006, plain_s=0.001)
    assert len(s._get(4).drafted_s.samples) >= 3
    # Sixteen: no draft forward at all, not even to time it (it would cost more still).
    big = run(s, [1.4] * 16, 8 * PROBE_EVERY, drafted_s=0.02, plain_s=0.0015)
    assert not any(big)
    # One sequence (smaller) is no lower bound: it is still timed.
    alone = run(s, [1.4], 4 * PROBE_EVERY, drafted_s=0.0012, plain_s=0.001)
    assert any(alone)


def test_a_probe_lasts_probe_length_steps() -> None:
    """A pipeline times a micro-batch only among micro-batches of its kind: each choice
    against the preference (the first timings, then the probes) holds for probe_length
    steps, and the preferred side resumes after."""
    s = SpeculationSwitch()
    s.probe_length = 3
    accepted = [3.0]
    assert [s.allow(accepted) for _ in range(3)] == [True] * 3  # drafting timed first
    s.observe(1, True, 2.0)
    assert [s.allow(accepted) for _ in range(3)] == [False] * 3  # then plain
    s.observe(1, False, 1.0)  # drafting: 4 tokens for 2x the time
    choices = [s.allow(accepted) for _ in range(PROBE_EVERY + 4)]
    assert choices[:PROBE_EVERY] == [True] * PROBE_EVERY
    assert choices[PROBE_EVERY:PROBE_EVERY + 3] == [False] * 3  # a plain probe of 3
    assert choices[-1] is True


def test_a_step_of_another_batch_size_ends_a_probe_run() -> None:
    s = SpeculationSwitch()
    s.probe_length = 3
    assert s.allow([3.0]) is True  # drafting timed first, held for two more steps
    s.observe(1, True, 2.0)
    assert s.allow([3.0] * 8) is True  # another bucket, untimed too: its own run
    assert s.allow([3.0]) is False  # batch 1 chooses afresh: plain, still untimed
