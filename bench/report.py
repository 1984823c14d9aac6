"""The benchmark's result: a JSON document, a printed table with ratios, and a plot."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import Any

from meshserve.bench.metrics import RunResult, aggregate, summarize
from meshserve.bench.peer_names import MESHSERVE
from meshserve.bench.roofline import (
    Roofline,
    decode_bytes,
    prefill_flops,
    utilization,
)
from meshserve.bench.rounds import Rounds
from meshserve.models.arch import ModelArch

HIGHER_IS_BETTER = ("throughput_tok_s", "total_tok_s", "requests_per_s", "goodput_req_s")
"""Ratios of these are ours / theirs; of the latencies, theirs / ours: > 1 favours meshserve."""

LATENCIES = ("ttft_s.p50", "ttft_s.p99", "tpot_s.p50", "tpot_s.p99", "e2e_s.p50", "e2e_s.p99")


def efficiency(run: RunResult, arch: ModelArch, itemsize: int,
               roof: Roofline | None) -> dict[str, float]:
    """MBU of decode steps, and for a lone request MBU from TPOT and prefill MFU from TTFT."""
    if roof is None:
        return {}
    bw, flops = roof.read_bandwidth_gbs * 1e9, roof.matmul_gflops * 1e9
    out: dict[str, float] = {}
    steps = run.extra.get("decode_steps")
    if steps and steps["num_steps"]:
        out["mbu_decode_steps"] = utilization(steps["bytes_read"], steps["time_s"], bw)
    if len(run.records) == 1:
        r = run.records[0]
        # decode step k (1 <= k < G) reads P + k tokens of KV: P + G/2 on average
        step_bytes = decode_bytes(arch, itemsize, r.num_prompt_tokens
                                  + r.num_generated_tokens / 2)
        out["roofline_tpot_s"] = step_bytes / bw
        if r.tpot is not None:
            out["mbu_tpot"] = utilization(step_bytes, r.tpot, bw)
        if r.ttft is not None:
            out["mfu_prefill"] = utilization(prefill_flops(arch, r.num_prompt_tokens), r.ttft,
                                             flops)
    return out


def summarize_engine(runs: list[RunResult], warmup: RunResult | None, *, arch: ModelArch,
                     itemsize: int, roof: Roofline | None, threads: int, slo: tuple[float, float]
                     ) -> dict[str, Any]:
    """Each timed run's metrics (with efficiency and CPU share), and min/median/max over them."""
    summaries = []
    for run in runs:
        s = summarize(run, *slo)
        s["efficiency"] = efficiency(run, arch, itemsize, roof)
        s["cpu_share"] = run.extra.get("cpu_share", math.nan) / threads
        s["extra"] = run.extra
        summaries.append(s)
    return {"runs": summaries, "aggregate": aggregate(summaries),
            "warmup": summarize(warmup, *slo) if warmup else None}


def ratios(engines: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """meshserve against each peer, on medians and on each side's best run."""
    ours = engines[MESHSERVE]["aggregate"]
    out = {}
    for peer, data in engines.items():
        if peer == MESHSERVE:
            continue
        theirs = data["aggregate"]
        row = {}
        for key in (*HIGHER_IS_BETTER, *LATENCIES):
            if key not in ours or key not in theirs:
                continue
            a, b = ours[key], theirs[key]
            if key in HIGHER_IS_BETTER:
                row[key] = {"median": _div(a["median"], b["median"]), "best": _div(a["max"], b["max"])}
            else:
                row[key] = {"median": _div(b["median"], a["median"]), "best": _div(b["min"], a["min"])}
        out[peer] = row
    return out


def _div(a: float, b: float) -> float:
    return a / b if b and not math.isnan(b) else math.nan


def build_result(*, rounds: Rounds, checks: dict[str, Any], arch: ModelArch, itemsize: int,
                 roof: Roofline | None, threads: int, slo: tuple[float, float],
                 meta: dict[str, Any]) -> dict[str, Any]:
    """The whole JSON document."""
    engines = {n: summarize_engine(runs, rounds.warmup.get(n), arch=arch, itemsize=itemsize,
                                   roof=roof, threads=threads, slo=slo)
               for n, runs in rounds.timed.items()}
    return {
        **meta,
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "threads": threads, **meta.get("machine", {})},
        "roofline": roof.as_dict() if roof else None,
        "protocol": {"warmup": bool(rounds.warmup), "repeats": len(next(iter(rounds.timed.values()))),
                     "round_order": rounds.order, "aggregate": "min, median and max over the "
                     "timed runs; ratios: > 1 means meshserve is better (throughput ours/theirs, "
                     "latency theirs/ours), 'best' compares each side's best run"},
        "engines": engines,
        "ratios": ratios(engines) if MESHSERVE in engines else {},
        "outputs": checks,
    }


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    """Strict JSON: NaN and infinities become null."""
    path = Path(path)
    path.write_text(json.dumps(_finite(result), indent=1))
    return path


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def table(result: dict[str, Any]) -> str:
    """Engines' figures (median over runs, best in brackets) and meshserve's ratios."""
    head = (f"{'engine':16s} {'gen tok/s med (best)':>21s} {'total tok/s':>11s} "
            f"{'TTFT p50/p99 ms':>16s} {'TPOT p50/p99 ms':>16s} {'E2E p50 s':>9s} "
            f"{'MBU':>6s} {'cpu':>5s}")
    lines = [head, "-" * len(head)]
    for name, data in result["engines"].items():
        a = data["aggregate"]
        med = {k: v["median"] for k, v in a.items()}
        mbu = med.get("efficiency.mbu_tpot", med.get("efficiency.mbu_decode_steps", math.nan))
        lines.append(
            f"{name:16s} {med['throughput_tok_s']:10.1f} ({a['throughput_tok_s']['max']:7.1f}) "
            f"{med['total_tok_s']:11.1f} {1e3 * med['ttft_s.p50']:7.0f}/{1e3 * med['ttft_s.p99']:<8.0f} "
            f"{1e3 * med['tpot_s.p50']:7.1f}/{1e3 * med['tpot_s.p99']:<8.1f} {med['e2e_s.p50']:9.2f} "
            f"{_pct(mbu):>6s} {_pct(med.get('cpu_share', math.nan)):>5s}")
    lines += _rank_lines(result)
    lines += _ratio_lines(result)
    return "\n".join(lines)


def _rank_lines(result: dict[str, Any]) -> list[str]:
    """Per rank of a multi-rank meshserve run: busy, waiting for activations, bubble
    (medians over the timed runs)."""
    data = result["engines"].get(MESHSERVE)
    if data is None:
        return []
    med = {k: v["median"] for k, v in data["aggregate"].items()}
    ranks = sorted({k.split(".")[1] for k in med if k.startswith("ranks.")},
                   key=lambda r: int(r[1:]))
    if not ranks:
        return []
    lines = ["meshserve ranks (share of wall time; bubble = 1 - busy):"]
    for r in ranks:
        m = {k.split(".")[2]: v for k, v in med.items() if k.startswith(f"ranks.{r}.")}
        lines.append(f"  rank {r[1:]} (pp stage {m['pp_rank']:.0f}, tp rank {m['tp_rank']:.0f}): "
                     f"busy {_pct(m['busy'])}, waiting for activations "
                     f"{_pct(m['input_wait'])}, bubble {_pct(m['bubble'])}")
    return lines


def _ratio_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    if result["ratios"]:
        lines.append("meshserve vs peer (> 1: meshserve better; median, best in brackets):")
    for peer, row in result["ratios"].items():
        parts = [f"{k.replace('_tok_s', '').replace('_s.', ' ')} x{v['median']:.2f} "
                 f"({v['best']:.2f})" for k, v in row.items()
                 if k in ("throughput_tok_s", "ttft_s.p50", "tpot_s.p50", "e2e_s.p50")]
        same = result["outputs"]["against_reference"].get(peer, {})
        parts.append(f"outputs identical {same.get('num_identical')}/{same.get('num_requests')}")
        lines.append(f"  vs {peer:14s} " + "; ".join(parts))
    return lines


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"
