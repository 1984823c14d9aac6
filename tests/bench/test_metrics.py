"""Metrics, roofline arithmetic, ratios and the protocol's pure parts, with exact values."""

from __future__ import annotations

import math

import pytest

from meshserve.bench.checkpoints import SPECS
from meshserve.bench.metrics import RequestRecord, RunResult, aggregate, percentile, summarize
from meshserve.bench.report import _rank_lines, ratios
from meshserve.bench.roofline import (
    decode_bytes,
    kv_bytes_per_token,
    prefill_flops,
    utilization,
    weight_bytes_read,
)
from meshserve.bench.rounds import compare_outputs, round_order
from meshserve.launch.cli_config import load_config
from meshserve.models.arch import ModelArch


def rec(arrival: float, first: float, finish: float, n: int, tokens: list[int] | None = None
        ) -> RequestRecord:
    return RequestRecord(arrival=arrival, first_token=first, finish=finish,
                         num_prompt_tokens=10, num_generated_tokens=n, token_ids=tokens or [])


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0 and math.isnan(percentile([], 50))


def test_request_record_latencies() -> None:
    r = rec(1.0, 1.5, 3.5, 5)
    assert (r.ttft, r.tpot, r.e2e) == (0.5, 0.5, 2.5)
    assert rec(0.0, 1.0, 1.0, 1).tpot is None


def test_summarize_counts_only_generated_tokens_over_the_wall() -> None:
    run = RunResult("x", [rec(0.0, 0.5, 2.0, 4), rec(0.0, 1.0, 4.0, 4)], wall_s=4.0)
    s = summarize(run, slo_ttft_s=0.6, slo_tpot_s=10.0)
    assert s["throughput_tok_s"] == 2.0 and s["total_tok_s"] == 7.0
    assert s["ttft_s"]["p50"] == 0.75 and s["tpot_s"]["mean"] == 0.75
    assert s["goodput_req_s"] == 0.25  # only the first meets the TTFT objective
    assert "prefix_cache_hit_rate" not in s  # peers don't report a cache


def test_rank_busy_shares_and_bubble_per_rank() -> None:
    ranks = [dict(rank=0, pp_rank=0, tp_rank=0, busy_s=3.0, input_wait_s=0.0,
                  num_micro_batches=9),
             dict(rank=1, pp_rank=1, tp_rank=0, busy_s=2.0, input_wait_s=1.5,
                  num_micro_batches=9)]
    run = RunResult("meshserve", [rec(0.0, 0.5, 4.0, 4)], wall_s=4.0, extra={"ranks": ranks})
    s = summarize(run, slo_ttft_s=1.0, slo_tpot_s=10.0)
    assert s["ranks"]["r1"] == {"pp_rank": 1, "tp_rank": 0, "busy": 0.5, "input_wait": 0.375,
                                "bubble": 0.5}
    result = {"engines": {"meshserve": {"aggregate": aggregate([s])}}}
    assert _rank_lines(result)[1:] == [
        "  rank 0 (pp stage 0, tp rank 0): busy 75%, waiting for activations 0%, bubble 25%",
        "  rank 1 (pp stage 1, tp rank 0): busy 50%, waiting for activations 38%, bubble 50%"]
    assert "ranks" not in summarize(RunResult("x", run.records, 4.0), 1.0, 10.0)


def test_aggregate_and_ratio_directions() -> None:
    runs = [{"throughput_tok_s": t, "ttft_s": {"p50": f}} for t, f in ((10, 1.0), (30, 3.0),
                                                                        (20, 2.0))]
    agg = aggregate(runs)
    assert agg["throughput_tok_s"] == {"min": 10, "median": 20, "max": 30}
    peer = aggregate([{"throughput_tok_s": 10.0, "ttft_s": {"p50": 4.0}}])
    r = ratios({"meshserve": {"aggregate": agg}, "hf": {"aggregate": peer}})["hf"]
    assert r["throughput_tok_s"] == {"median": 2.0, "best": 3.0}
    assert r["ttft_s.p50"] == {"median": 2.0, "best": 4.0}


def test_bench_md_tiny_bytes() -> None:
    arch = ModelArch(**SPECS["tiny"])
    assert arch.num_params == 56_369_664  # docs/benchmarks/README.md: 56.4 M
    assert weight_bytes_read(arch, 4) == (56_369_664 - 32000 * 512) * 4
    assert kv_bytes_per_token(arch, 4) == 2 * 8 * 4 * 64 * 4
    assert decode_bytes(arch, 4, 300) == weight_bytes_read(arch, 4) + 300 * 16384
    tied = ModelArch(**SPECS["tiny"], tie_word_embeddings=True)
    assert weight_bytes_read(tied, 4) == tied.num_params * 4


def test_prefill_flops_and_utilization() -> None:
    arch = ModelArch(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
    per_token = 2 * (4 * (4 + 2 * 2) + 4 * 4 + 3 * 4 * 8)
    assert prefill_flops(arch, 3) == per_token * 3 + 2 * 2 * 4 * 6 + 2 * 4 * 10
    assert utilization(50.0, 2.0, 100.0) == 0.25 and math.isnan(utilization(1.0, 0.0, 1.0))


def test_round_order_rotates() -> None:
    names = ["a", "b", "c"]
    assert [round_order(names, r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_compare_outputs_reports_the_first_divergence() -> None:
    ref = RunResult("a", [rec(0, 1, 2, 3, [1, 2, 3]), rec(0, 1, 2, 2, [4, 5])], 1.0)
    other = RunResult("b", [rec(0, 1, 2, 3, [1, 9, 3]), rec(0, 1, 2, 2, [4, 5])], 1.0)
    out = compare_outputs(ref, other)
    assert out["num_identical"] == 1 and not out["identical"]
    assert out["mismatches"] == [{"request": 0, "first_diff_token": 1, "num_tokens": [3, 3]}]
    assert compare_outputs(ref, ref)["identical"]


@pytest.mark.parametrize(("override", "message"), [
    ("bench.peers=[hf-static-0]", r"bench\.peers=\['hf-static-0'\] is invalid"),
    ("bench.peers=[vllm]", r"bench\.peers=\['vllm'\] is invalid: allowed is distinct names"),
    ("bench.repeats=0", r"bench\.repeats=0 is invalid"),
    ("bench.model=huge", r"bench\.model='huge' is invalid: allowed is null or one of \['120m', "),
    ("bench.rate=-1", r"bench\.rate=-1\.0 is invalid"),
    ("bench.num_requests=0", r"bench\.num_requests=0 is invalid"),
])
def test_bench_config_rejects_bad_values(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config([override])


def test_meshserve_single_is_a_peer_name() -> None:
    assert load_config(["bench.peers=[meshserve-single,hf-static-8]"]).bench.peers == [
        "meshserve-single", "hf-static-8"]
    with pytest.raises(ValueError, match="hf-continuous and meshserve-single"):
        load_config(["bench.peers=[meshserve-single,meshserve-single]"])


def test_bench_config_defaults_follow_bench_md() -> None:
    b = load_config([]).bench
    assert b.peers == ["hf-static-8", "hf-static-16", "hf-continuous"]
    assert b.repeats == 3 and b.warmup and b.hf_max_batch_tokens == 512
