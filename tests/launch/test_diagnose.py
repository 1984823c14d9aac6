"""`meshserve generate engine.step_log=...` then `meshserve diagnose` on what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MESHSERVE = str(Path(sys.executable).with_name("meshserve"))


def meshserve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([MESHSERVE, *args], capture_output=True, text=True, timeout=300,
                          env=env)


def generate_and_diagnose(tmp_path: Path, *layout: str) -> tuple[list[dict], dict]:
    """Generate with `layout`, then diagnose with no layout given: it comes from the run
    header the engine wrote first."""
    steps = tmp_path / "steps.jsonl"
    gen = meshserve("generate", f"engine.step_log={steps}", "generate.max_tokens=6",
                    "generate.ignore_eos=true", *layout)
    assert gen.returncode == 0, gen.stderr[-3000:]
    header, *rows = [json.loads(line) for line in steps.read_text().splitlines()]
    assert header["run"]["model_name"] == "meshcoder"
    out = meshserve("diagnose", f"diagnose.records={steps}", "format=json")
    assert out.returncode == 0, out.stderr[-3000:]
    return [r for r in rows if "stages" not in r], json.loads(out.stdout)


def stage_lines(tmp_path: Path) -> list[list[dict]]:
    lines = (tmp_path / "steps.jsonl").read_text().splitlines()
    return [row["stages"] for row in map(json.loads, lines) if "stages" in row]


def test_generate_then_diagnose_names_a_bottleneck(tmp_path: Path) -> None:
    rows, d = generate_and_diagnose(tmp_path, "parallel=single")
    assert sum(r["num_decode_seqs"] for r in rows) == 3 * 5  # three prompts, 6 tokens each
    assert (d["model"], d["tp"], d["pp"], d["num_steps"]) == ("meshcoder", 1, 1, len(rows))
    assert d["bottleneck"] in d["seconds"] and d["strategy"]
    assert d["total_s"] == pytest.approx(sum(r["wall_s"] for r in rows))
    assert d["seconds"]["pipeline_bubbles"] == 0.0


def test_a_speculating_run_says_how_much_drafted_and_whether_it_paid(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    gen = meshserve("generate", f"engine.step_log={steps}", "generate.max_tokens=48",
                    "generate.ignore_eos=true", "parallel=single", "speculative=draft",
                    "speculative.max_batch_size=3")
    assert gen.returncode == 0, gen.stderr[-3000:]
    rows = [json.loads(line) for line in steps.read_text().splitlines()[1:]]
    drafted = [r for r in rows if r.get("num_draft_tokens")]
    assert drafted and all(r["num_accepted_tokens"] <= r["num_draft_tokens"] for r in drafted)
    assert sum(r["num_decode_seqs"] + r.get("num_accepted_tokens", 0) for r in rows) == 3 * 47
    out = meshserve("diagnose", f"diagnose.records={steps}", "format=json")
    assert out.returncode == 0, out.stderr[-3000:]
    sp = json.loads(out.stdout)["speculation"]
    assert sp["num_drafted_steps"] == len(drafted)
    assert sp["num_draft_tokens"] == sum(r["num_draft_tokens"] for r in drafted)
    assert sp["verdict"]
    text = meshserve("diagnose", f"diagnose.records={steps}")
    assert "speculative decoding:" in text.stdout and "drafts accepted" in text.stdout


@pytest.mark.slow
def test_a_pipeline_of_one_micro_batch_measures_its_known_bubble(tmp_path: Path) -> None:
    """pp=2 with one micro-batch in flight: each stage idles while the other runs, so
    each stage's time is its own work plus its wait for the other's (about half the step
    time on an idle machine; less when other processes share the cores, where work
    stretches). The diagnosis takes the bubbles measured (the ranks' stage times the engine
    wrote), not the cost model's."""
    rows, d = generate_and_diagnose(tmp_path, "parallel.pp=2", "parallel.num_micro_batches=1")
    assert {r["num_in_flight"] for r in rows} == {1}
    assert d["pp"] == 2 and d["num_steps"] == len(rows)
    assert d["sources"]["pipeline_bubbles"] == "measured"
    assert d["seconds"]["communication"] == 0.0  # tp=1: no collectives
    first, *_, last = stage_lines(tmp_path)
    assert [s["pp_rank"] for s in last] == [0, 1] and not any(s["busy_s"] for s in first)
    busy = [s["busy_s"] for s in last]
    waits = [s["input_wait_s"] for s in last]
    scheduler = d["seconds"]["scheduler"]
    executor = d["total_s"] - scheduler
    bubble = d["seconds"]["pipeline_bubbles"]
    assert bubble == pytest.approx((waits[0] + waits[1] - scheduler) / 2)
    assert 0.1 <= bubble / executor <= 0.75, (bubble, executor)
    # every stage is either working or waiting for the other: its time is most of the run's
    # (stage 0 also runs the scheduler, which stage 1 waits through; what is neither, its
    # own bookkeeping, stretches when the test suite's other worker shares the cores)
    for span in (busy[0] + waits[0] + scheduler, busy[1] + waits[1]):
        assert 0.5 * d["total_s"] <= span <= 1.1 * d["total_s"], (busy, waits, d["total_s"])
    text = meshserve("diagnose", f"diagnose.records={tmp_path / 'steps.jsonl'}").stdout
    assert "(measured)" in text and "(modelled)" in text and "(residual)" in text


def test_diagnose_reads_a_file_a_running_engine_is_writing(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    line = json.dumps({"num_decode_seqs": 4, "num_decode_context_tokens": 400, "wall_s": 0.01})
    steps.write_text(f"{line}\n{line}\n{line[:17]}")
    out = meshserve("diagnose", f"diagnose.records={steps}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("2 steps, 0.020 s: meshcoder")
    assert f"{steps}:3: skipped the last line, still being written (17 chars)" in out.stderr


def test_an_automatic_step_budget_is_in_the_records_and_the_diagnosis(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    gen = meshserve("generate", f"engine.step_log={steps}", "generate.max_tokens=8",
                    "generate.ignore_eos=true", "parallel=single",
                    "engine.max_num_batched_tokens=auto", "scenario.tpot_slo_ms=20")
    assert gen.returncode == 0, gen.stderr[-3000:]
    header, *rows = [json.loads(line) for line in steps.read_text().splitlines()]
    assert header["run"]["tpot_slo_ms"] == 20
    assert rows and all(r["token_budget"] >= r["num_decode_seqs"] + r["num_prefill_tokens"]
                        for r in rows)
    out = meshserve("diagnose", f"diagnose.records={steps}", "format=json")
    assert out.returncode == 0, out.stderr[-3000:]
    sb = json.loads(out.stdout)["step_budget"]
    assert sb["num_steps"] == len(rows) and sb["target_s"] == pytest.approx(0.02)
    assert sb["num_decode_steps"] == sum(1 for r in rows if r["num_decode_seqs"])
    text = meshserve("diagnose", f"diagnose.records={steps}")
    assert "step budget: automatic on" in text.stdout and "TPOT target of 20.0 ms" in text.stdout
