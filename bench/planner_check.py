"""The planner's closed-form goodput against its own step simulation, per preset and layout.

    python -m meshserve.bench.planner_check [--cases meshcoder-rag ...] [--max-ratio 1.15]

The planner ranks layouts by closed forms (queueing waits, stalls, the decode batch's
spread); its step simulation (parallel/planner/layout_sim.py) serves the scenario's
requests step by step on the same cost model, slower and closer to the engine. A change
to either that moves them apart shows here first. For each case (a model, a cluster
preset and a scenario, under the goodput objective) it prices one rank, tp=2, dp=2 and
the best prefill/decode split both ways. Prints one line per layout (closed, simulated,
their ratio), writes every row to OUT/planner_check.json, and exits 1 if a ratio lies
outside [1 / max_ratio, max_ratio].
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.models.bundled import resolve_arch
from meshserve.parallel.planner.disagg_search import simulated_goodput, splits
from meshserve.parallel.planner.search import evaluate, options_for, shape_for

CASES: dict[str, list[str]] = {
    "llama-3-8b-rag": ["model=llama-3-8b", "cluster=dgx-h100", "scenario=rag"],
    "llama-3-8b-chatbot": ["model=llama-3-8b", "cluster=dgx-h100", "scenario=chatbot"],
    "meshcoder-rag": ["model=meshcoder", "cluster=local-cpu", "scenario=rag"],
    "meshcoder-chatbot": ["model=meshcoder", "cluster=local-cpu", "scenario=chatbot"],
}
"""A datacenter GPU preset and this CPU, each under a prompt-heavy and a chat scenario."""

COLOCATED = ((1, 1), (2, 1), (1, 2))
"""(tp, dp) of the colocated layouts priced."""


def check_case(name: str) -> list[dict[str, Any]]:
    """Every layout of one case, priced both ways."""
    config = load_runtime_config(CASES[name])
    cluster = config.cluster
    shape = shape_for(config, resolve_arch(config.model), cluster.device_type)
    options = options_for(config)
    scenario = dataclasses.replace(config.scenario, objective="throughput")
    layouts: list[tuple[str, Any]] = [
        (f"tp={tp} dp={dp}", evaluate(shape, cluster, scenario, (tp, 1, dp), options))
        for tp, dp in COLOCATED]
    split = next((c for c in splits(shape, cluster, scenario, options) if c.rejected is None),
                 None)
    if split is not None:
        layouts.append((split.degrees, split))
    rows = []
    for layout_name, layout in layouts:
        if layout.prediction is None:
            continue  # rejected (does not fit)
        start = time.perf_counter()
        simulated = simulated_goodput(shape, cluster, scenario, options, layout)
        closed = layout.prediction.goodput_req_s
        rows.append({"case": name, "layout": layout_name, "closed_req_s": closed,
                     "simulated_req_s": simulated, "ratio": closed / simulated,
                     "seconds": time.perf_counter() - start})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--max-ratio", type=float, default=1.15)
    parser.add_argument("--out", default="bench-results/planner-check")
    args = parser.parse_args(argv)
    rows = []
    for name in args.cases:
        for row in check_case(name):
            rows.append(row)
            print(f"{row['case']:20s} {row['layout']:40s} closed {row['closed_req_s']:8.3f} "
                  f"simulated {row['simulated_req_s']:8.3f} x{row['ratio']:.2f} "
                  f"({row['seconds']:.1f} s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "planner_check.json").write_text(json.dumps(rows, indent=1))
    far = [r for r in rows if not 1 / args.max_ratio <= r["ratio"] <= args.max_ratio]
    print(f"{len(rows) - len(far)} of {len(rows)} layouts within x{args.max_ratio}")
    return 1 if far else 0


if __name__ == "__main__":
    sys.exit(main())
