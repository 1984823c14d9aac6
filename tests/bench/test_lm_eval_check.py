"""The lm-evaluation-harness bench's local task: well-formed items, written as lm-eval
reads a task from a directory (the harness itself runs in the bench, not here)."""

from __future__ import annotations

import json
from pathlib import Path

from meshserve.bench.lm_eval_check import TASK, snippet_items, write_task


def test_items_have_four_distinct_choices_and_a_gold_that_varies() -> None:
    items = snippet_items(24)
    for it in items:
        assert len(set(it["choices"])) == 4 and 0 <= it["gold"] < 4
        op = it["choices"][it["gold"]].split()[0]
        name = it["context"].split("(")[0].removeprefix("def ")
        assert (name, op) in {("add", "+"), ("subtract", "-"), ("multiply", "*"),
                              ("divide", "/"), ("power", "**"), ("modulo", "%")}
    assert {it["gold"] for it in items} == {0, 1, 2, 3}


def test_task_files_point_at_their_data(tmp_path: Path) -> None:
    root = write_task(tmp_path, 5)
    yaml = (root / f"{TASK}.yaml").read_text()
    data = tmp_path / "snippets.jsonl"
    assert f"test: {data}" in yaml and "output_type: multiple_choice" in yaml
    assert len([json.loads(x) for x in data.read_text().splitlines()]) == 5
