"""Greedy tokens against another commit: where two sides first differ, and one real case
run on both sides (this checkout against its own HEAD)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshserve.bench import token_parity
from meshserve.bench.token_parity import compare


def test_compare_finds_the_first_difference() -> None:
    assert compare([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == {"identical": True}
    assert compare([[1, 2], [3, 4, 5]], [[1, 2], [3, 9, 5]]) == {
        "identical": False, "prompt": 1, "first_difference": 1}
    assert compare([[1, 2]], [[1, 2, 3]]) == {"identical": False, "prompt": 0,
                                              "first_difference": 2}


@pytest.mark.slow
def test_one_case_against_head(tmp_path: Path) -> None:
    code = token_parity.main(["--base", "HEAD", "--layouts", "single",
                              "--models", "llama-gqa", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "parity.json").read_text())
    assert code == 0 and [(r["model"], r["layout"], r["identical"]) for r in rows] == [
        ("llama-gqa", "single", True)]
    assert rows[0]["tokens"] == len(token_parity.ID_PROMPTS) * token_parity.MAX_TOKENS
