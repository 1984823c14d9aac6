"""`meshserve bench` as a user runs it: JSON result, plot, peers equal to meshserve, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from meshserve.bench.workloads import BenchRequest, save
from meshserve.launch.cli import main

MESHSERVE = str(Path(sys.executable).with_name("meshserve"))
PEERS = ["hf-static-2", "hf-continuous"]


@pytest.fixture(scope="module")
def result(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[dict, Path, subprocess.CompletedProcess[str]]:
    ckpt = make_checkpoint("llama", seed=4)
    tmp = tmp_path_factory.mktemp("bench")
    save([BenchRequest(list(range(1, 30)), 5), BenchRequest([9, 8, 7], 2),
          BenchRequest(list(range(40, 60)), 7)], tmp / "wl.json")
    out = subprocess.run(
        [MESHSERVE, "bench", f"model.path={ckpt}", "parallel=single",
         f"bench.workload={tmp / 'wl.json'}",
         f"bench.peers=[{','.join(PEERS)}]", "bench.repeats=1", f"bench.out={tmp / 'out'}",
         "bench.roofline_read_bytes=16777216", "bench.roofline_matmul_size=128",
         "engine.kv_cache_memory=16777216"],
        capture_output=True, text=True, timeout=300, cwd=tmp,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp / "out" / "result.json").read_text()), tmp / "out", out


def test_json_has_every_engine_and_sane_figures(result: tuple[dict, Path, object]) -> None:
    res, _, _ = result
    assert {"workload", "model", "machine", "roofline", "protocol", "engines", "ratios",
            "outputs"} <= set(res)
    assert res["workload"]["num_requests"] == 3 and res["workload"]["num_max_new_tokens"] == 14
    assert res["machine"]["threads"] == 1 and res["roofline"]["read_bandwidth_gbs"] > 0
    assert list(res["engines"]) == ["meshserve", *PEERS]
    assert res["protocol"]["repeats"] == 1 and res["protocol"]["round_order"] == [
        ["meshserve", *PEERS]]
    for name, eng in res["engines"].items():
        assert len(eng["runs"]) == 1 and eng["warmup"] is not None, name
        for run in eng["runs"]:
            assert run["num_generated_tokens"] == 14
            assert run["throughput_tok_s"] == pytest.approx(14 / run["wall_s"])
            assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p99"] <= run["wall_s"] + 1e-9
            assert run["tpot_s"]["p50"] > 0
        agg = eng["aggregate"]["throughput_tok_s"]
        assert agg["min"] <= agg["median"] <= agg["max"]
    ours = res["engines"]["meshserve"]["runs"][0]
    assert ours["prefix_cache_hit_rate"] == 0.0 and ours["prefill_tokens_computed"] == 52
    assert ours["efficiency"]["mbu_decode_steps"] > 0
    assert set(res["ratios"]) == set(PEERS)
    assert res["ratios"]["hf-static-2"]["throughput_tok_s"]["median"] > 0


def test_peers_outputs_equal_meshserve(result: tuple[dict, Path, object]) -> None:
    checks = result[0]["outputs"]
    assert checks["reference"] == "meshserve"
    for peer in PEERS:
        assert checks["against_reference"][peer]["identical"], checks["against_reference"][peer]
    assert all(checks["deterministic_across_runs"].values())


def test_table_and_plot(result: tuple[dict, Path, subprocess.CompletedProcess[str]]) -> None:
    _, out_dir, proc = result
    assert (out_dir / "result.png").read_bytes()[:4] == b"\x89PNG"
    assert "gen tok/s" in proc.stdout and "vs hf-continuous" in proc.stdout
    assert "outputs identical 3/3" in proc.stdout


@pytest.mark.parametrize(("workload", "message"), [
    ("nope", "bench.workload='nope' is invalid"),
    ("/nowhere/wl.json", "bench.workload='/nowhere/wl.json': not a readable workload file"),
])
def test_bad_workload_exits_nonzero_naming_the_key(
        workload: str, message: str, make_checkpoint: Callable[..., Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_checkpoint("llama", seed=4)
    code = main(["bench", f"model.path={ckpt}", f"bench.workload={workload}"])
    assert code == 2
    assert message in capsys.readouterr().err


def test_workload_too_long_for_the_model(make_checkpoint: Callable[..., Path],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = make_checkpoint("llama", seed=4)  # max_position_embeddings=256, vocab 320
    assert main(["bench", f"model.path={ckpt}", "bench.workload=latency"]) == 2
    err = capsys.readouterr().err
    assert "bench.workload='latency': request 0 needs 256 + 128 tokens" in err
    assert "max_model_len=256" in err


@pytest.mark.slow
def test_a_layout_against_meshserve_single_in_one_run(make_checkpoint: Callable[..., Path],
                                                      tmp_path: Path) -> None:
    """bench.peers=[meshserve-single]: a pp=2 run and our engine on one rank, rounds
    interleaved in one process, with the same tokens out."""
    ckpt = make_checkpoint("llama", seed=4)
    save([BenchRequest(list(range(1, 30)), 5), BenchRequest([9, 8, 7], 2)], tmp_path / "wl.json")
    out = subprocess.run(
        [MESHSERVE, "bench", f"model.path={ckpt}", f"bench.workload={tmp_path / 'wl.json'}",
         "bench.peers=[meshserve-single]", "bench.repeats=2", "bench.warmup=false",
         f"bench.out={tmp_path / 'out'}", "bench.roofline=false", "bench.plot=false",
         "engine.kv_cache_memory=16777216", "parallel.pp=2", "threads=1"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    assert list(res["engines"]) == ["meshserve", "meshserve-single"]
    assert res["protocol"]["round_order"] == [["meshserve", "meshserve-single"],
                                              ["meshserve-single", "meshserve"]]
    assert "ranks" in res["engines"]["meshserve"]["runs"][0]  # the pp=2 side: two ranks
    assert "ranks" not in res["engines"]["meshserve-single"]["runs"][0]
    assert res["outputs"]["against_reference"]["meshserve-single"]["identical"]
    assert res["ratios"]["meshserve-single"]["throughput_tok_s"]["median"] > 0
    assert "vs meshserve-single throughput" in out.stdout
