"""`meshserve plan` as a user runs it: JSON for machines, a table for people, clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MESHSERVE = str(Path(sys.executable).with_name("meshserve"))


def meshserve(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([MESHSERVE, *args], capture_output=True, text=True, timeout=300,
                          env=env)


def test_plan_json_for_70b_on_two_dgx_h100() -> None:
    out = meshserve("plan", "model=llama-3-70b", "cluster=dgx-h100-2node", "scenario=chatbot",
                    "format=json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["tp"], plan["pp"], plan["dp"]) == (8, 1, 2)
    assert plan["stage_layers"] == [[0, 80]] and plan["num_micro_batches"] == 1
    predicted = plan["predicted"]
    for key in ("ttft_ms", "tpot_ms", "throughput_tok_s", "goodput_req_s", "batch"):
        assert predicted[key] > 0, key
    assert predicted["meets_slo"] is True
    # chatbot speculates: drafts priced at the operating batch, paying for a 70B model
    assert 0 < predicted["speculative_decode_ms"] < predicted["decode_ms"]
    degrees = [(c["tp"], c["pp"], c["dp"]) for c in plan["candidates"]]
    assert degrees[:2] == [(8, 1, 2), (8, 2, 1)]
    assert len(degrees) == 15 and degrees.index((8, 2, 1)) < degrees.index((16, 1, 1))
    tp16 = plan["candidates"][degrees.index((16, 1, 1))]
    assert tp16["rejected"].startswith("TP=16 spans NVLink domains of 8")
    no_fit = plan["candidates"][degrees.index((1, 1, 16))]
    assert no_fit["rejected"].startswith("weights 141.1 GB") and no_fit["predicted"] is None
    assert [(r["node"], r["dp_rank"]) for r in plan["rank_map"]] == [(0, 0)] * 8 + [(1, 1)] * 8


def test_plan_table_for_8b_offline_on_pcie_l40s() -> None:
    out = meshserve("plan", "model=llama-3-8b", "cluster=l40s-pcie", "scenario=offline",
                    "plan.top=3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("model llama-3-8b (8.0B params, bfloat16) on l40s-pcie")
    assert lines[4].split()[:4] == ["*1", "1", "1", "8"]
    assert "... 7 more (plan.top=0 shows all)" in out.stdout
    assert "chosen: tp=1 pp=1 dp=8, 1 micro-batch(es); stage 0: layers 0-31" in out.stdout
    assert "speculative decoding" not in out.stdout  # offline does not speculate
    assert out.stdout.rstrip().splitlines()[-1].split() == ["7", "0", "7", "7", "0", "0", "mixed"]


def test_plan_that_cannot_fit_exits_2_naming_the_reasons() -> None:
    out = meshserve("plan", "model=llama-3-70b", "cluster=local-cpu")
    assert out.returncode == 2
    assert "no layout fits" in out.stderr and "tp=2 pp=1 dp=1: weights" in out.stderr
    assert "Traceback" not in out.stderr


def test_diagnose_json_names_the_bottleneck(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text("\n".join(json.dumps(r) for r in [
        {"num_decode_seqs": 8, "num_decode_context_tokens": 8000, "wall_s": 0.006,
         "scheduler_s": 0.0005},
        {"num_decode_seqs": 8, "num_decode_context_tokens": 8100, "wall_s": 0.006}]) + "\n")
    out = meshserve("diagnose", f"diagnose.records={steps}", "model=llama-3-8b",
                    "cluster=dgx-h100", "scenario=chatbot", "format=json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert (d["tp"], d["num_steps"], d["bottleneck"]) == (1, 2, "decode_memory")
    assert d["total_s"] == 0.012 and abs(sum(d["seconds"].values()) - 0.012) < 1e-12
    assert "speculative decoding" in d["strategy"]


def test_diagnose_bad_record_names_line_and_field(tmp_path: Path) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text('{"wall_s": 0.1}\n{"wall_s": 0.1, "num_tokens": 3}\n')
    out = meshserve("diagnose", f"diagnose.records={steps}", "model=llama-3-8b",
                    "cluster=dgx-h100")
    assert out.returncode == 2
    assert f"{steps}:2: unknown field(s) ['num_tokens']" in out.stderr


def test_plan_says_where_speculation_does_not_pay() -> None:
    """The bundled model on this CPU at the chatbot's batch: the verify step's extra rows
    cost more than the accepted drafts give back, as measured (docs/benchmarks)."""
    out = meshserve("plan", "model=meshcoder", "cluster=local-cpu", "scenario=chatbot")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "assuming 2 of 4 drafts accepted per verify step" in text
    assert "it does not pay there" in text


def test_plan_disagg_auto_prints_both_kinds_and_picks() -> None:
    args = ("plan", "model=llama-3-70b", "cluster=dgx-h100", "scenario=rag",
            "scenario.prompt_len=4000", "scenario.shared_prefix_fraction=0",
            "scenario.output_len=256", "scenario.ttft_slo_ms=4000", "scenario.tpot_slo_ms=20",
            "disagg=auto")
    out = meshserve(*args, "format=json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["candidates"] and doc["disagg"]["chosen"] == "disaggregated"
    best = doc["disagg"]["splits"][0]
    assert best["predicted"]["goodput_req_s"] > doc["predicted"]["goodput_req_s"]
    assert best["prefill"]["tp"] * best["prefill"]["replicas"] * best["prefill"]["pp"] \
        + best["decode"]["tp"] * best["decode"]["replicas"] * best["decode"]["pp"] == 8
    assert best["link"] == "intra" and best["kv_bytes_per_request"] > 0
    text = meshserve(*args, "plan.top=3")
    assert text.returncode == 0, text.stderr
    assert "prefill/decode splits (disagg=auto)" in text.stdout
    assert "chosen: disaggregated serving" in text.stdout
    assert "start it with: disagg=manual disagg.prefill.replicas=" in text.stdout
    assert "more (plan.top=N shows N; format=json lists all)" in text.stdout
    chat = meshserve("plan", "model=llama-3-8b", "cluster=dgx-h100", "scenario=chatbot",
                     "disagg=auto", "format=json")
    assert json.loads(chat.stdout)["disagg"]["chosen"] == "colocated"


def test_plan_simulate_ranks_the_finalists_by_simulated_goodput() -> None:
    out = meshserve("plan", "model=llama-3-70b", "cluster=dgx-h200", "scenario=codegen",
                    "disagg=auto", "plan.simulate=true", "format=json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)["disagg"]
    sim = doc["simulated_goodput_req_s"]
    assert sim["colocated"] > 0 and sim["split"] > 0
    assert "Simulated goodput" in doc["explanation"]
    assert doc["chosen"] == ("disaggregated" if sim["split"] > 1.1 * sim["colocated"]
                             else "colocated")
