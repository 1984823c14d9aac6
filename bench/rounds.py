"""The benchmark protocol (docs/benchmarks/README.md): one warm-up, then rounds that run every engine once, alternating."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from meshserve.bench.harness import Runner
from meshserve.bench.metrics import RunResult
from meshserve.bench.workloads import BenchRequest


@dataclass
class Rounds:
    """Every engine's warm-up run and timed runs."""

    warmup: dict[str, RunResult] = field(default_factory=dict)
    timed: dict[str, list[RunResult]] = field(default_factory=dict)
    order: list[list[str]] = field(default_factory=list)
    """Engine order of each timed round."""


def round_order(names: list[str], round_index: int) -> list[str]:
    """Round r starts with engine r mod n, so no engine always runs first or last."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def run_rounds(runners: list[Runner], reqs: list[BenchRequest], *, repeats: int,
               warmup: bool = True, progress: bool = True) -> Rounds:
    """Warm up each runner once (untimed), then `repeats` rounds in rotating order."""
    by_name = {r.name: r for r in runners}
    names = list(by_name)
    total = (int(warmup) + repeats) * len(runners) * len(reqs)
    out = Rounds(timed={n: [] for n in names})
    with tqdm(total=total, unit="req", disable=not progress, dynamic_ncols=True) as bar:
        if warmup:
            for name in names:
                bar.set_description(f"warm-up {name}")
                out.warmup[name] = _timed_run(by_name[name], reqs, bar)
        for r in range(repeats):
            order = round_order(names, r)
            out.order.append(order)
            for name in order:
                bar.set_description(f"round {r + 1}/{repeats} {name}")
                res = _timed_run(by_name[name], reqs, bar)
                out.timed[name].append(res)
                tok_s = sum(x.num_generated_tokens for x in res.records) / res.wall_s
                bar.set_postfix_str(f"{name} {tok_s:.1f} tok/s")
    return out


def _timed_run(runner: Runner, reqs: list[BenchRequest], bar: tqdm) -> RunResult:
    cpu0, t0 = time.process_time(), time.perf_counter()
    res = runner.run(reqs, on_finish=lambda: bar.update(1))
    # CPU seconds of this process per second of the whole call (set-up included): well
    # below the thread count means other processes took the cores.
    res.extra["cpu_share"] = (time.process_time() - cpu0) / (time.perf_counter() - t0)
    return res


def compare_outputs(ref: RunResult, other: RunResult) -> dict[str, Any]:
    """Request-by-request token equality of `other` against `ref`, with the first divergence."""
    mismatches = []
    for i, (a, b) in enumerate(zip(ref.records, other.records)):
        if a.token_ids != b.token_ids:
            first = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                         min(len(a.token_ids), len(b.token_ids)))
            mismatches.append({"request": i, "first_diff_token": first,
                               "num_tokens": [len(a.token_ids), len(b.token_ids)]})
    return {"num_requests": len(ref.records),
            "num_identical": len(ref.records) - len(mismatches),
            "identical": not mismatches and len(ref.records) == len(other.records),
            "mismatches": mismatches}


def check_outputs(rounds: Rounds, reference: str) -> dict[str, Any]:
    """Every engine against `reference`'s first run, and every run against its own first."""
    runs = {n: ([rounds.warmup[n]] if n in rounds.warmup else []) + rounds.timed[n]
            for n in rounds.timed}
    ref = runs[reference][0]
    against = {n: compare_outputs(ref, rs[0]) for n, rs in runs.items() if n != reference}
    deterministic = {n: all(compare_outputs(rs[0], x)["identical"] for x in rs[1:])
                     for n, rs in runs.items()}
    return {"reference": reference, "against_reference": against,
            "deterministic_across_runs": deterministic}
