"""`meshserve VERB -m`: Hydra sweeps expanded, validated up front, one process per run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshserve.launch.cli_config import ConfigError
from meshserve.launch.sweep import expand

CLI = [sys.executable, "-m", "meshserve.launch.cli"]


def test_expand_is_hydras_cartesian_product() -> None:
    swept, combos = expand(["parallel.tp=1,2", "model=meshcoder", "engine.max_num_seqs=8,32"])
    assert swept == ["parallel.tp", "engine.max_num_seqs"]
    assert combos == [
        ["parallel.tp=1", "model=meshcoder", "engine.max_num_seqs=8"],
        ["parallel.tp=1", "model=meshcoder", "engine.max_num_seqs=32"],
        ["parallel.tp=2", "model=meshcoder", "engine.max_num_seqs=8"],
        ["parallel.tp=2", "model=meshcoder", "engine.max_num_seqs=32"],
    ]
    assert expand(["engine.max_num_seqs=range(1,4)"])[1] == [
        ["engine.max_num_seqs=1"], ["engine.max_num_seqs=2"], ["engine.max_num_seqs=3"]]


def test_malformed_sweep_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="sweep overrides"):
        expand(["parallel.tp=1,,2"])


@pytest.mark.parametrize(("override", "message"), [
    ("engine.max_num_seqs=0,8", "engine.max_num_seqs=0 is invalid: allowed is an int >= 1"),
    ("engine.max_num_sequences=4,8", "engine.max_num_sequences: unknown key; allowed keys"),
])
def test_a_bad_value_fails_the_sweep_before_any_run(tmp_path: Path, override: str,
                                                    message: str) -> None:
    out = subprocess.run([*CLI, "generate", "-m", override, "generate.max_tokens=1,2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert message in out.stderr
    assert not (tmp_path / "sweeps").exists()


@pytest.mark.slow
def test_bench_sweep_writes_a_json_per_run_and_a_summary(text3: Path, tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    out = subprocess.run(
        [*CLI, "bench", "-m", "parallel.tp=1,2", "engine.max_num_seqs=2,8",
         f"model.path='{text3}'", "bench.workload=short", "bench.num_requests=4",
         "bench.peers=[]", "bench.repeats=1", "bench.warmup=false", "bench.roofline=false",
         "bench.progress=false", f"bench.out={root}"],
        capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1",
                                                          "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((root / "summary.json").read_text())
    assert [r["swept"] for r in summary["runs"]] == [
        {"parallel.tp": tp, "engine.max_num_seqs": n} for tp in ("1", "2") for n in ("2", "8")]
    for i, run in enumerate(summary["runs"]):
        result = json.loads((root / f"run-{i:03d}" / "result.json").read_text())
        assert result["engines"]["meshserve"]["runs"][0]["num_requests"] == 4
        assert run["metrics"]["throughput_tok_s"] > 0
    assert (root / "summary.png").stat().st_size > 0
    table = out.stdout.splitlines()
    assert table[0].startswith("| run | parallel.tp | engine.max_num_seqs | exit | tok/s")
    assert len(table) == 2 + 4
