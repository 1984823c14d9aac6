"""The engine's step records: what a step ran and took, as `meshserve diagnose` reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshserve.engine.core.sampling_params import SamplingParams
from meshserve.engine.core.scheduler_output import ScheduledSeq
from meshserve.engine.llm import LLM
from meshserve.engine.timing.step_log import StepLog
from meshserve.launch.diagnose import read_records, run_overrides
from meshserve.parallel.comm.tp_group import CommCounters


def chunk(seq_id: int, num_tokens: int, start_pos: int) -> ScheduledSeq:
    return ScheduledSeq(seq_id, [7] * num_tokens, start_pos, [0], sample=True)


def test_records_round_trip_with_measured_communication(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "logs" / "steps.jsonl")
    log.write([chunk(0, 12, 0), chunk(1, 4, 16)], wall_s=0.03, scheduler_s=0.001)
    log.comm = counters = CommCounters()
    mark = log.comm_mark()
    counters.comm_s += 0.004
    log.write([chunk(0, 1, 12), chunk(1, 1, 20)], wall_s=0.01, scheduler_s=0.0005,
              comm_mark=mark, num_in_flight=2)
    log.close()
    log.close()
    got = read_records(str(tmp_path / "logs" / "steps.jsonl"))
    (prefill, decode), notes = got.steps, got.notes
    assert notes == [] and got.run is None
    assert (prefill.num_prefill_tokens, prefill.num_prefill_seqs,
            prefill.num_prefill_cached_tokens) == (16, 2, 16)
    assert (prefill.wall_s, prefill.scheduler_s, prefill.comm_s,
            prefill.num_in_flight) == (0.03, 0.001, None, None)
    assert (decode.num_decode_seqs, decode.num_decode_context_tokens) == (2, 32)
    assert decode.comm_s == pytest.approx(0.004) and decode.num_in_flight == 2


def test_a_file_still_being_written_is_read_up_to_its_last_whole_line(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    for _ in range(3):
        log.write([chunk(0, 1, 40)], wall_s=0.01, scheduler_s=0.0)
    log.close()
    whole = path.read_text()
    path.write_text(whole + whole.splitlines()[0][:25])  # a writer cut off mid-line
    got = read_records(str(path))
    assert len(got.steps) == 3
    assert got.notes == [f"{path}:4: skipped the last line, still being written (25 chars)"]
    path.write_text(whole.splitlines()[0][:25] + "\n" + whole)  # cut short mid-file: bad
    with pytest.raises(ValueError, match=rf"{path}:1: not JSON"):
        read_records(str(path))


def test_an_unwritable_step_log_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match=r"engine.step_log='.*a-file/steps.jsonl': cannot "
                                         r"append to it"):
        StepLog(tmp_path / "a-file" / "steps.jsonl")


def test_the_engine_writes_one_record_per_step(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    with LLM(overrides=[f"engine.step_log={path}", "engine.enable_prefix_caching=false",
                        "parallel=single"],
             progress=False) as llm:
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        num_steps = llm.engine.timing.num_steps
    got = read_records(str(path))
    records = got.steps
    assert got.notes == [] and len(records) == num_steps
    assert got.run is not None and got.run["model_name"] == "meshcoder"
    assert (got.run["tp"], got.run["pp"], got.run["scenario"]) == (1, 1, "chatbot")
    assert sum(r.num_prefill_tokens for r in records) == 8
    assert sum(r.num_decode_seqs for r in records) == 2 * 3  # the first token ends the prefill
    assert sum(r.num_decode_context_tokens for r in records) == (5 + 6 + 7) + (3 + 4 + 5)
    assert all(r.comm_s is None and r.num_in_flight is None and r.wall_s > 0 for r in records)


def test_a_file_of_several_runs_is_read_for_its_last_run(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    for tp in (1, 2):
        log = StepLog(path)
        log.write_run({"model_name": "m", "tp": tp, "pp": 1})
        for _ in range(tp + 1):
            log.write([chunk(0, 1, 40)], wall_s=0.01, scheduler_s=0.0)
        log.close()
    got = read_records(str(path))
    assert got.run == {"model_name": "m", "tp": 2, "pp": 1} and len(got.steps) == 3
    assert got.notes == [f"{path}: 1 earlier run(s) in the file skipped; diagnosing the last one"]


def test_a_run_header_fills_the_config_the_command_line_leaves_unset() -> None:
    run = {"model_name": "tiny", "model_path": "/m/tiny", "dtype": "float32", "tp": 2, "pp": 1,
           "scenario": "rag", "cluster": "my-calibrated-file"}
    assert run_overrides(run, []) == ["model.path='/m/tiny'", "model.name='tiny'",
                                      "model.dtype=float32", "parallel.tp=2", "parallel.pp=1",
                                      "scenario=rag"]  # not a preset: no cluster
    assert run_overrides(run, ["parallel=auto", "scenario=chatbot", "model.dtype=bfloat16"]) == [
        "model.path='/m/tiny'", "model.name='tiny'"]
    assert run_overrides(None, []) == []
