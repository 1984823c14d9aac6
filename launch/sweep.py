"""`meshserve VERB -m key=a,b other=x,y`: Hydra's multirun, one process per combination.

The sweep is expanded with Hydra's own override grammar (`a,b`, `range(1,4)`,
`choice(...)`) into the cartesian product, in Hydra's order (the last key varies
fastest). Every combination is composed and validated before the first run starts, so a
wrong key or value fails the sweep at once, naming the key. Each run is its own process
(its ranks, memory and process groups end with it) and writes into
`<root>/run-NNN/`; bench runs leave their result.json there. The sweep then writes
`<root>/summary.json`, a table on stdout and in `<root>/summary.md`, and, for bench,
`<root>/summary.png`.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from meshserve.bench.peer_names import MESHSERVE
from meshserve.launch.cli_config import ConfigError, load_config

SUMMARY_METRICS = (("throughput_tok_s", "tok/s"), ("requests_per_s", "req/s"),
                   ("goodput_req_s", "goodput req/s"), ("ttft_s.p50", "TTFT p50 s"),
                   ("tpot_s.p50", "TPOT p50 s"), ("ttft_s.p99", "TTFT p99 s"))
"""meshserve's medians that the bench summary shows, with their column titles."""


def expand(overrides: list[str]) -> tuple[list[str], list[list[str]]]:
    """(swept keys, one override list per combination)."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"sweep overrides {overrides}: {e}") from None
    axes: list[list[str]] = []
    swept: list[str] = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            swept.append(key.lstrip("+~"))
            axes.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return swept, [list(combo) for combo in itertools.product(*axes)]


def _root(verb: str, combos: list[list[str]]) -> Path:
    """bench.out when given (the same in every combination), else sweeps/<verb>-<time>."""
    outs = {o.split("=", 1)[1] for c in combos for o in c if o.startswith(f"{verb}.out=")}
    if len(outs) == 1:
        return Path(outs.pop()).expanduser()
    return Path("sweeps") / f"{verb}-{time.strftime('%Y%m%d-%H%M%S')}"


def run_sweep(verb: str, overrides: list[str]) -> int:
    """Run every combination; 0 when all of them succeeded."""
    swept, combos = expand(overrides)
    for combo in combos:  # fail before the first run, naming the key
        load_config(combo)
    root = _root(verb, combos)
    root.mkdir(parents=True, exist_ok=True)
    print(f"meshserve {verb}: sweep of {len(combos)} run(s) over {', '.join(swept) or '-'} "
          f"into {root}", file=sys.stderr)
    runs = []
    for i, combo in enumerate(combos):
        out = root / f"run-{i:03d}"
        out.mkdir(exist_ok=True)
        args = [o for o in combo if not o.startswith(f"{verb}.out=")]
        if verb == "bench":
            args.append(f"bench.out={out}")
        print(f"[{i + 1}/{len(combos)}] {' '.join(args)}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "meshserve.launch.cli", verb, *args],
                              capture_output=True, text=True)
        (out / "stdout.txt").write_text(proc.stdout)
        (out / "stderr.txt").write_text(proc.stderr)
        run = {"index": i, "overrides": combo, "swept": _swept_values(swept, combo),
               "returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
               "result": str(out / "result.json") if (out / "result.json").is_file() else None}
        (out / "run.json").write_text(json.dumps(run, indent=1))
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            print(f"  failed (exit code {proc.returncode}): {tail[0]}", file=sys.stderr)
        runs.append(run)
    summary = summarize(swept, runs)
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    text = summary_table(summary)
    (root / "summary.md").write_text(text + "\n")
    print(text)
    if verb == "bench" and any(r["metrics"] for r in summary["runs"]):
        plot_summary(summary, root / "summary.png")
    return 0 if all(r["returncode"] == 0 for r in runs) else 1


def _swept_values(swept: list[str], combo: list[str]) -> dict[str, str]:
    values = dict(o.lstrip("+~").split("=", 1) for o in combo if "=" in o)
    return {k: values[k] for k in swept}


def summarize(swept: list[str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each run's swept values, exit code and meshserve's median figures (bench runs)."""
    rows = []
    for run in runs:
        metrics: dict[str, float] = {}
        if run["result"]:
            agg = json.loads(Path(run["result"]).read_text())["engines"][MESHSERVE]["aggregate"]
            metrics = {k: agg[k]["median"] for k, _ in SUMMARY_METRICS if k in agg}
        rows.append({**run, "metrics": metrics})
    return {"swept": swept, "runs": rows}


def summary_table(summary: dict[str, Any]) -> str:
    """A Markdown table: one row per run."""
    cols = [k for k, _ in SUMMARY_METRICS if any(k in r["metrics"] for r in summary["runs"])]
    titles = dict(SUMMARY_METRICS)
    head = ["run", *summary["swept"], "exit", *(titles[c] for c in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in summary["runs"]:
        cells = [str(r["index"]), *(r["swept"][k] for k in summary["swept"]),
                 str(r["returncode"]), *(_fmt(r["metrics"].get(c)) for c in cols)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.1f}" if abs(x) >= 10 else f"{x:.3g}"


def plot_summary(summary: dict[str, Any], path: Path) -> Path | None:
    """Throughput against TPOT p50, one labelled point per run (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in summary["runs"]:
        m = r["metrics"]
        if "throughput_tok_s" in m and "tpot_s.p50" in m:
            ax.scatter(m["tpot_s.p50"] * 1e3, m["throughput_tok_s"])
            label = " ".join(f"{k.split('.')[-1]}={v}" for k, v in r["swept"].items())
            ax.annotate(label, (m["tpot_s.p50"] * 1e3, m["throughput_tok_s"]), fontsize=7)
    ax.set_xlabel("TPOT p50 (ms)")
    ax.set_ylabel("generated tok/s")
    ax.set_title("meshserve sweep: throughput vs latency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
