"""bench.capacity: a replica's saturated throughput, timed on the engine and simulated."""

from __future__ import annotations

import json

import pytest

from meshserve.bench import capacity
from meshserve.parallel.planner.serving_sim import wave_rate


def test_wave_rate_counts_the_middle_two_waves() -> None:
    ends = [3.0, 3.0, 6.0, 6.0, 9.0, 9.0, 12.0, 12.0]
    assert wave_rate(ends, 2) == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="at least 3 x seqs"):
        wave_rate(ends[:5], 2)


def test_a_small_burst_is_timed_and_simulated(capsys: pytest.CaptureFixture[str]) -> None:
    capacity.main(["--prompt", "40", "--output", "4", "--max-seqs", "2", "--budget", "64"])
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["measured_req_s"] > 0 and row["simulated_req_s"] > 0
    assert row["measured_over_simulated"] == pytest.approx(
        row["measured_req_s"] / row["simulated_req_s"], rel=1e-2)
