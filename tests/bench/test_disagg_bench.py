"""The disaggregation benchmark holds 1P+1D against the colocated layout that served the
most requests within the SLOs, and of those the one with the lowest TPOT p99: goodputs of
layouts serving the same requests differ only by when their last one ended."""

from __future__ import annotations

from meshserve.bench.disagg import best_colocated


def test_best_colocated_counts_requests_then_tpot() -> None:
    rows = {"dp=2": {"goodput_req_s": 0.2874, "num_within_slo": 24, "tpot_p99_ms": 25.7},
            "tp=2": {"goodput_req_s": 0.2890, "num_within_slo": 24, "tpot_p99_ms": 21.7},
            "1x-auto": {"goodput_req_s": 0.2892, "num_within_slo": 24, "tpot_p99_ms": 47.3}}
    assert best_colocated(rows) == "tp=2"
    rows["1x-auto"]["num_within_slo"] = 25
    assert best_colocated(rows) == "1x-auto"
