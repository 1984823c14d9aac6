"""The online bench against transformers' own `transformers serve` (the peer server)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from meshserve.bench.workloads import BenchRequest, save
from meshserve.launch.cli import main
from meshserve.models.bundled import resolve_model_dir
from meshserve.parallel.comm.discovery import free_port


@pytest.mark.slow
def test_bench_against_transformers_serve(tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="transformers serve needs accelerate")
    exe = Path(sys.executable).with_name("transformers")
    if not exe.exists():
        pytest.skip("no transformers CLI next to this python")
    model = str(resolve_model_dir("meshcoder", None))
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen([str(exe), "serve", model, "--port", str(port), "--device", "cpu"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.5)
        reqs = [BenchRequest(list(range(30 + i, 45 + i)), 3 + i) for i in range(2)]
        save(reqs, tmp_path / "wl.json")
        code = main(["bench", f"bench.url={url}", f"bench.workload={tmp_path / 'wl.json'}",
                     "bench.api=transformers", "bench.rates=[10]",
                     f"bench.out={tmp_path / 'out'}", "bench.plot=false"])
        assert code == 0
        (r,) = json.loads((tmp_path / "out" / "result.json").read_text())["rates"]
        assert r["num_failed"] == 0, r["failures"]
        # min_new_tokens through its generation_config: exactly the asked lengths
        assert r["num_generated_tokens"] == sum(q.max_new_tokens for q in reqs)
        assert 0 < r["ttft_s"]["p50"] <= r["e2e_s"]["p99"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
