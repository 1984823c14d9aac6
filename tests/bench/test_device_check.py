"""The prepared GPU device check, in its CPU smoke mode (Triton kernels in the interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshserve.bench import device_check


@pytest.mark.slow
def test_smoke_run_writes_every_section(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "meshserve.bench.device_check", "--smoke",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "device_check.json").read_text())
    results = doc["results"]
    assert list(results) == list(device_check.SECTIONS)
    assert {k: v.get("error") for k, v in results.items()} == dict.fromkeys(results)
    assert results["kernels"]["ok"] is True
    assert set(results["decode"]) >= {"batch1", "batch2"}
    assert results["decode"]["batch1"]["meshserve_tok_s"] > 0
    assert results["longtail"]["meshserve_tok_s"] > 0
    assert "HBM copy GB/s" in proc.stdout and "longtail speedup" in proc.stdout
    kv = results["kv"]  # every wire a CPU has, the KV checked on arrival
    assert kv["torch-gloo"]["256_gbs"] > 0 and kv["torch-gloo_pairs"]["256_gbs"] > 0
    assert kv["torch-nccl"] == {"skipped": "needs GPUs"}
    assert "KV pull torch-gloo_pairs, 256 tokens GB/s" in proc.stdout


FAILING_SECTION = """
import sys, torch
from pathlib import Path
from meshserve.bench import device_check
s = device_check.sizes(True, torch.device("cpu"))
broken = type(s)(**{**s.__dict__, "copy_bytes": -4})  # torch.empty(-1) raises
saved = []
results = device_check.run_sections(broken, Path(sys.argv[1]), ("copy", "kernels"),
                                    Path(sys.argv[1]), lambda r: saved.append(list(r)))
assert saved == [["copy"], ["copy", "kernels"]], saved  # kept after every section
assert "RuntimeError" in results["copy"]["error"], results["copy"]
assert "error" not in results["kernels"] and results["kernels"]["ok"] is True, results
assert "ERROR" in device_check.table(results)
"""


def test_a_failing_section_is_recorded_and_the_rest_run(tmp_path: Path) -> None:
    # A fresh process: TRITON_INTERPRET only counts before Triton's first import, and
    # another test (or transformers) may have imported it in this one already.
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", FAILING_SECTION, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_full_run_refuses_a_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit):
        device_check.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        device_check.main(["--smoke", "--out", str(tmp_path), "--sections", "nope"])
