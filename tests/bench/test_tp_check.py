"""The tensor-parallel comparison: its cases, its table, and a smoke run of meshserve TP=1
against TP=2 (and DeepSpeed-Inference where it is installed) on a small checkpoint."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from meshserve.bench.tp_cases import (
    CASE_NAMES,
    CaseResult,
    make_cases,
    median_step_seconds,
    select_cases,
)
from meshserve.bench.tp_check import equal_tokens, main, table


def test_cases_are_the_same_for_every_engine() -> None:
    a, b = make_cases(1000, decode_tokens=8), make_cases(1000, decode_tokens=8)
    assert a == b
    assert [c.name for c in a] == list(CASE_NAMES)
    ttft, one, many = a
    assert [len(p) for p in ttft.prompts] == [512] and ttft.max_new_tokens == 1
    assert [len(p) for p in one.prompts] == [256] and one.max_new_tokens == 8
    assert len(many.prompts) == 32 and {len(p) for p in many.prompts} == {16}
    assert all(1 <= t < 1000 for c in a for p in c.prompts for t in p)
    assert [c.name for c in select_cases(a, "decode-32,ttft")] == ["ttft", "decode-32"]
    with pytest.raises(ValueError, match=r"cases='prefill': allowed are"):
        select_cases(a, "prefill")


def test_decode_step_is_the_median_gap_and_tokens_count_to_the_first_difference() -> None:
    assert median_step_seconds([0.0, 1.0, 3.0, 4.0]) == 1.0
    with pytest.raises(ValueError, match="at least 2"):
        median_step_seconds([1.0])
    assert equal_tokens([[1, 2, 3], [4, 5]], [[1, 9, 3], [4, 5]]) == (3, 5)


def test_table_gives_speed_up_and_agreement_against_the_reference() -> None:
    results = {
        "meshserve TP=1": [CaseResult("ttft", "ttft_s", [2.0, 2.2], [[7]])],
        "meshserve TP=2": [CaseResult("ttft", "ttft_s", [1.0, 1.2], [[7]])],
        "DeepSpeed TP=2": [CaseResult("ttft", "ttft_s", [1.1], [[8]])],
    }
    rows = table(results, "meshserve TP=1").splitlines()
    assert rows[2] == "| ttft (ttft_s) | meshserve TP=1 | 2100.0 ms | x1.00 | 1/1 |"
    assert rows[3] == "| ttft (ttft_s) | meshserve TP=2 | 1100.0 ms | x1.91 | 1/1 |"
    assert rows[4] == "| ttft (ttft_s) | DeepSpeed TP=2 | 1100.0 ms | x1.91 | 0/1 |"


@pytest.mark.slow
def test_tp2_runs_every_case_with_the_outputs_of_tp1(make_checkpoint, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    model = make_checkpoint("llama", max_position_embeddings=1024)
    out = tmp_path / "tp.json"
    skip = "" if importlib.util.find_spec("deepspeed") else "deepspeed"
    assert main(["--model", str(model), "--repeats", "1", "--decode-tokens", "3",
                 "--skip", skip, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    engines = ["meshserve TP=1", "meshserve TP=2"] + ([] if skip else ["DeepSpeed TP=2"])
    assert list(data) == engines
    for engine in engines:
        assert [c["name"] for c in data[engine]] == list(CASE_NAMES)
        for case, ref in zip(data[engine], data["meshserve TP=1"]):
            assert len(case["seconds"]) == 1 and case["seconds"][0] > 0
            assert case["token_ids"] == ref["token_ids"], (engine, case["name"])
    assert "| decode-32 (tpot_s) | meshserve TP=2 |" in printed
    # DeepSpeed leaves ~70 MB of shared memory per rank behind; the peer removes it.
    assert list(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) == []
