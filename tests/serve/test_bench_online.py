"""`meshserve bench bench.url=...`: a Poisson-rate sweep against a real server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshserve.bench.workloads import BenchRequest, save
from meshserve.launch.cli import main


@pytest.mark.slow
def test_rate_sweep_reports_latency_goodput_and_a_plot(server, tmp_path: Path, capsys) -> None:
    reqs = [BenchRequest(list(range(10 + i, 30 + 2 * i)), 3 + i % 3) for i in range(6)]
    save(reqs, tmp_path / "wl.json")
    before = server.metrics()
    code = main(["bench", f"bench.url={server.url}", f"bench.workload={tmp_path / 'wl.json'}",
                 "bench.rates=[20,80]", f"bench.out={tmp_path / 'out'}", "bench.seed=3"])
    assert code == 0
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    assert res["mode"] == "online" and res["server"]["model"] == "meshcoder"
    assert [r["rate_req_s"] for r in res["rates"]] == [20.0, 80.0]
    for r in res["rates"]:
        assert r["num_requests"] == 6 and r["num_failed"] == 0, r["failures"]
        assert r["prefix_cache_reset"]
        assert r["num_generated_tokens"] == sum(q.max_new_tokens for q in reqs)
        assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] <= r["e2e_s"]["p99"]
        assert 0 < r["tpot_s"]["p50"] <= r["tpot_s"]["p99"]
        assert 0 <= r["goodput_req_s"] <= r["requests_per_s"]
    assert (tmp_path / "out" / "result.png").stat().st_size > 0
    # Each rate started cold: the second one computed its prompts again (they share no
    # prefix with each other, so a warm cache would be the only source of hits).
    after = server.metrics()
    hits = "meshserve_prefix_cache_hits_total"
    assert after[hits] == before[hits]
    out = capsys.readouterr().out
    assert "TTFT p99" in out and out.count("\n    20 ") + out.count("\n    80 ") == 2


def test_unreachable_server_names_bench_url(tmp_path: Path, capsys) -> None:
    code = main(["bench", "bench.url=http://127.0.0.1:9", "bench.workload=short",
                 f"bench.out={tmp_path}"])
    assert code == 2
    assert "bench.url='http://127.0.0.1:9'" in capsys.readouterr().err


def test_request_bodies_per_api() -> None:
    from meshserve.bench.online import ServerInfo, request_body

    info, req = ServerInfo("http://x", "m", None), BenchRequest([5, 6, 7], 4)
    ids = request_body("token-ids", info, req, None)
    assert ids["prompt"] == [5, 6, 7] and ids["ignore_eos"] and ids["max_tokens"] == 4
    text = request_body("text", info, req, lambda t: "abc")
    assert text["prompt"] == "abc" and text["ignore_eos"] and text["stream_options"]
    hf = request_body("transformers", info, req, lambda t: "abc")
    assert json.loads(hf["generation_config"]) == {"max_new_tokens": 4, "min_new_tokens": 4,
                                                   "do_sample": False}
    assert "ignore_eos" not in hf  # transformers serve answers 422 to fields it does not know
    with pytest.raises(ValueError, match="tokenizer"):
        request_body("text", info, req, None)


@pytest.mark.slow
def test_text_api_counts_tokens_from_usage(server, tmp_path: Path) -> None:
    reqs = [BenchRequest(list(range(40 + i, 60 + i)), 4 + i) for i in range(3)]
    save(reqs, tmp_path / "wl.json")
    code = main(["bench", f"bench.url={server.url}", f"bench.workload={tmp_path / 'wl.json'}",
                 "bench.api=text", "bench.rates=[50]", f"bench.out={tmp_path / 'out'}",
                 "bench.plot=false"])
    assert code == 0
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    (r,) = res["rates"]
    assert res["server"]["api"] == "text" and r["num_failed"] == 0, r["failures"]
    assert r["num_generated_tokens"] == sum(q.max_new_tokens for q in reqs)


def test_bad_api_names_the_field(tmp_path: Path, capsys) -> None:
    code = main(["bench", "bench.url=http://127.0.0.1:9", "bench.api=grpc",
                 f"bench.out={tmp_path}"])
    assert code == 2
    assert "bench.api" in capsys.readouterr().err
