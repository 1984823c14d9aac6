"""The run-time switch: drafts where drafted steps deliver more tokens/s at this batch
size, plain steps where they do not, each side measured again now and then."""

from __future__ import annotations

from meshserve.engine.speculation_switch import PROBE_EVERY, SpeculationSwitch


def run(switch: SpeculationSwitch, num_seqs: int, steps: int, drafted_rate: float,
        plain_rate: float) -> list[bool]:
    choices = []
    for _ in range(steps):
        draft = switch.allow(num_seqs)
        choices.append(draft)
        switch.observe(num_seqs, draft, 100, 100 / (drafted_rate if draft else plain_rate))
    return choices


def test_it_keeps_the_faster_side_and_probes_the_other() -> None:
    s = SpeculationSwitch()
    small = run(s, 1, 200, drafted_rate=300.0, plain_rate=200.0)
    assert small[:2] == [True, False]  # each side measured once
    assert sum(small[2:]) > 0.9 * len(small[2:])  # then drafting
    assert 0 < small[2:].count(False) <= len(small) // PROBE_EVERY + 1  # plain probed
    large = run(s, 64, 200, drafted_rate=800.0, plain_rate=1000.0)  # another bucket
    assert sum(large[2:]) <= len(large) // PROBE_EVERY + 1
    assert s.num_drafted_steps + s.num_plain_steps == 400


def test_it_follows_a_change_of_workload() -> None:
    s = SpeculationSwitch()
    run(s, 2, 100, drafted_rate=100.0, plain_rate=300.0)
    after = run(s, 2, 300, drafted_rate=600.0, plain_rate=300.0)
    assert sum(after[-100:]) > 90
