"""This checkout against another commit, in one run: `meshserve bench` cases, rounds alternating.

    python -m meshserve.bench.against_commit --base HEAD~1 --rounds 3 [--model tiny-bf16]

A restructuring must not cost speed, and this machine drifts by several percent between
minutes: so both sides run in the same run, one case at a time, the side that goes first
alternating from round to round. The base commit is checked out as a git worktree in a
temporary directory and imported through PYTHONPATH ahead of the installed checkout; both
sides use this checkout's virtual environment. Prints one JSON line per run, then per case
and figure both sides' values and the ratio of their means (this checkout / the base), and
writes every row to OUT/rows.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["bench.peers=[]", "bench.repeats=1", "bench.warmup=false", "threads=1",
          "bench.plot=false", "bench.roofline=false", "bench.progress=false"]
CASES = {
    "longtail-1rank": ["bench.workload=longtail", "parallel=single"],
    "longtail-pp2": ["bench.workload=longtail", "parallel.pp=2"],
    "latency-1rank": ["bench.workload=latency", "parallel=single"],
}
"""The cases a restructuring is held to: throughput on one rank and in a pipeline, and
batch-1 latency."""
FIGURES = (("throughput_tok_s", "tok/s"), ("tpot_p50_ms", "TPOT p50 ms"))


def side_env(pythonpath: str | None) -> dict[str, str]:
    """One side's environment: one OpenMP thread, and the base's worktree first on the
    path (None: this checkout, as installed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return env


def bench_once(pythonpath: str | None, args: list[str], out: Path,
               model: str = "tiny") -> dict[str, float]:
    """One `meshserve bench` run of bench checkpoint `model`; its throughput and TPOT p50."""
    env = side_env(pythonpath)
    cmd = [sys.executable, "-m", "meshserve.launch.cli", "bench", f"bench.model={model}",
           *COMMON, *args, f"bench.out={out}"]
    done = subprocess.run(cmd, cwd=tempfile.gettempdir(), env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    run = json.loads((out / "result.json").read_text())["engines"]["meshserve"]["runs"][0]
    return {"throughput_tok_s": run["throughput_tok_s"],
            "tpot_p50_ms": run["tpot_s"]["p50"] * 1e3}


def base_package(base: str, tmp: Path) -> str:
    """A worktree of `base` importable as `meshserve`: the PYTHONPATH entry for it."""
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), base],
                   check=True, capture_output=True)
    (tmp / "path").mkdir()
    (tmp / "path" / "meshserve").symlink_to(tree)
    return str(tmp / "path")


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per case and figure: both sides' values and the ratio of their means."""
    lines = []
    for case in dict.fromkeys(r["case"] for r in rows):
        for key, label in FIGURES:
            ours = [r[key] for r in rows if r["case"] == case and r["side"] == "this"]
            base = [r[key] for r in rows if r["case"] == case and r["side"] == "base"]
            ratio = statistics.fmean(ours) / statistics.fmean(base)
            lines.append(f"{case:16s} {label:12s} this {[round(x, 1) for x in ours]} "
                         f"base {[round(x, 1) for x in base]} ratio {ratio:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the commit to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--model", default="tiny", help="a bench checkpoint name")
    parser.add_argument("--out", default="bench-results/against-commit")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        pythonpath = base_package(args.base, Path(tmp))
        try:
            for r in range(args.rounds):
                for case in args.cases:
                    sides = [("this", None), ("base", pythonpath)]
                    for side, path in sides if r % 2 == 0 else sides[::-1]:
                        figures = bench_once(path, CASES[case], out / f"{case}-{side}-{r}",
                                             args.model)
                        rows.append({"case": case, "side": side, "round": r, **figures})
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(Path(tmp) / "tree")], capture_output=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
