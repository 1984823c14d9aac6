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


def plot_sweep(summaries: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """Latency against achieved throughput over a sweep of rates (TTFT, TPOT p50 / p99),
    and goodput against the offered rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [s for s in summaries if s.get("num_requests")]
    xs = [s["requests_per_s"] for s in runs]
    fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 4.2))
    for ax, key, name in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(xs, [1e3 * s[key][q] for s in runs], style, label=q)
        ax.set_xlabel("achieved requests/s")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} against throughput")
        ax.legend()
    offered = [s["rate_req_s"] or 0.0 for s in runs]
    axes[2].plot(offered, xs, "o-", label="completed req/s")
    axes[2].plot(offered, [s["goodput_req_s"] for s in runs], "s--", label="goodput req/s")
    axes[2].set_xlabel("offered requests/s (0: all at once)")
    axes[2].set_title("goodput under the SLOs")
    axes[2].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
