"""The commit comparison's summary: both sides' values per case and the ratio of means."""

from __future__ import annotations

from meshserve.bench.against_commit import summary


def test_summary_gives_each_case_both_sides_and_the_ratio_of_means() -> None:
    rows = [{"case": "latency-1rank", "side": s, "round": r, "throughput_tok_s": t,
             "tpot_p50_ms": p}
            for s, r, t, p in [("this", 0, 40.0, 25.0), ("base", 0, 50.0, 20.0),
                               ("base", 1, 30.0, 20.0), ("this", 1, 40.0, 15.0)]]
    assert summary(rows) == [
        "latency-1rank    tok/s        this [40.0, 40.0] base [50.0, 30.0] ratio 1.000",
        "latency-1rank    TPOT p50 ms  this [25.0, 15.0] base [20.0, 20.0] ratio 1.000",
    ]
