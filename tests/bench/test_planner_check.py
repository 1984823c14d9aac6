"""The planner's closed forms against its step simulation: every layout of a case priced
both ways, and a ratio outside the bound fails the run."""

from __future__ import annotations

import json
from pathlib import Path

from meshserve.bench.planner_check import main


def test_a_case_prices_every_layout_both_ways(tmp_path: Path) -> None:
    assert main(["--cases", "meshcoder-chatbot", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "planner_check.json").read_text())
    assert [r["layout"] for r in rows] == ["tp=1 dp=1", "tp=2 dp=1", "tp=1 dp=2",
                                           "P 1 x (tp=1 pp=1) + D 1 x (tp=1 pp=1)"]
    assert all(r["simulated_req_s"] > 0 and 1 / 1.15 <= r["ratio"] <= 1.15 for r in rows)


def test_a_ratio_past_the_bound_fails(tmp_path: Path) -> None:
    """(tp=2 here is priced 9% above its simulation.)"""
    assert main(["--cases", "meshcoder-chatbot", "--max-ratio", "1.05",
                 "--out", str(tmp_path)]) == 1
