"""A PNG of a benchmark result: throughput and latency percentiles per engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Three panels: generated tok/s (median bar, min..max whisker), TTFT and TPOT p50/p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["engines"])
    agg = [result["engines"][n]["aggregate"] for n in names]
    xs = list(range(len(names)))
    fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 4.2))
    med = [a["throughput_tok_s"]["median"] for a in agg]
    lo = [m - a["throughput_tok_s"]["min"] for m, a in zip(med, agg)]
    hi = [a["throughput_tok_s"]["max"] - m for m, a in zip(med, agg)]
    axes[0].bar(xs, med, yerr=[lo, hi], capsize=4,
                color=["tab:blue" if n == "meshserve" else "tab:gray" for n in names])
    axes[0].set_title("generated tokens/s (median, min..max)")
    for ax, key, scale, unit in ((axes[1], "ttft_s", 1e3, "ms"), (axes[2], "tpot_s", 1e3, "ms")):
        for offset, q in ((-0.2, "p50"), (0.2, "p99")):
            vals = [scale * a.get(f"{key}.{q}", {}).get("median", float("nan")) for a in agg]
            ax.bar([x + offset for x in xs], vals, width=0.4, label=q)
        ax.set_title(f"{key.split('_')[0].upper()} ({unit}, median over runs)")
        ax.legend()
    for ax in axes:
        ax.set_xticks(xs, names, rotation=20, ha="right")
        ax.grid(axis="y", alpha=0.3)
    w = result["workload"]
    fig.suptitle(f"{w['name']} ({w['num_requests']} requests) on {result['model']['name']}, "
                 f"{result['machine']['threads']} thread(s); {result['protocol']['repeats']} runs")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
