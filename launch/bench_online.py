"""`meshserve bench bench.url=...`: the online mode, against a running server.

    meshserve serve model=meshcoder serve.port=8000 &
    meshserve bench bench.url=http://127.0.0.1:8000 bench.workload=short \\
        bench.rates=[1,2,4,8] bench.out=DIR

Replays the workload at each Poisson rate (or all at once when no rate is given),
writes DIR/result.json and DIR/result.png (latency against throughput, goodput against
the offered rate) and prints one line per rate.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from meshserve.bench import workloads
from meshserve.bench.online import server_info, sweep
from meshserve.bench.plot import plot_sweep
from meshserve.bench.report import write_json
from meshserve.launch.options import CliConfig
from meshserve.models.arch import ModelArch
from meshserve.models.bundled import resolve_model_dir
from meshserve.models.tokenizer import Tokenizer
from meshserve.serve.serve_config import API_KEY_ENV


def run_online(cfg: CliConfig) -> int:
    """Sweep the configured rates against bench.url; 1 when no request completed."""
    b = cfg.bench
    assert b.url is not None
    api_key = b.api_key or os.environ.get(API_KEY_ENV) or None
    info = server_info(b.url, api_key)
    # The workloads are token ids: the client needs the served model's vocabulary (and, to
    # send text, its tokenizer).
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.path)
    arch = ModelArch.from_dir(model_dir)
    decode = None
    if b.api != "token-ids":
        tok = Tokenizer(model_dir)
        decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    limit = info.max_model_len or arch.max_position_embeddings

    def reqs_at(rate: float | None) -> list[workloads.BenchRequest]:
        reqs = workloads.resolve(b.workload, arch.vocab_size, seed=b.seed,
                                 num_requests=b.num_requests, rate=rate)
        for i, r in enumerate(reqs):
            if len(r.prompt_token_ids) + r.max_new_tokens > limit:
                raise ValueError(f"bench.workload={b.workload!r}: request {i} needs "
                                 f"{len(r.prompt_token_ids)} + {r.max_new_tokens} tokens; the "
                                 f"server allows at most max_model_len={limit}")
        return reqs

    rates: list[float | None] = list(b.rates) or [b.rate]
    reqs_at(rates[0])  # fail on a workload that does not fit before sending anything
    print(f"=== online bench {b.workload} against {info.url} ({info.model}, api {b.api}), "
          f"rates {rates} req/s", flush=True)
    print(_HEADER, flush=True)
    load_start = os.getloadavg()
    summaries = sweep(info, reqs_at, rates, api_key=api_key, timeout_s=b.request_timeout_s,
                      slo=(b.slo_ttft_s, b.slo_tpot_s),
                      on_done=lambda s: print(_row(s), flush=True), api=b.api,
                      decode=decode)
    result = _result(cfg, info.model, info.url, summaries, load_start)
    out = Path(b.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    written = [write_json(result, out / "result.json")]
    if b.plot:
        written.append(plot_sweep(summaries, out / "result.png",
                                  f"{b.workload} against {info.model} at {info.url}"))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if any(s.get("num_requests") for s in summaries) else 1


_HEADER = (f"{'rate':>6} {'done':>5} {'failed':>6} {'req/s':>7} {'tok/s':>8} "
           f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'goodput':>8}")


def _row(s: dict[str, Any]) -> str:
    rate = "burst" if s["rate_req_s"] is None else f"{s['rate_req_s']:g}"
    if not s.get("num_requests"):
        return f"{rate:>6} {0:>5} {s['num_failed']:>6}  (no request completed)"

    def ms(key: str, q: str) -> str:
        v = s[key][q]
        return f"{1e3 * v:7.1f}ms" if not math.isnan(v) else f"{'-':>9}"

    return (f"{rate:>6} {s['num_requests']:>5} {s['num_failed']:>6} {s['requests_per_s']:>7.2f} "
            f"{s['throughput_tok_s']:>8.1f} {ms('ttft_s', 'p50'):>9} {ms('ttft_s', 'p99'):>9} "
            f"{ms('tpot_s', 'p50'):>9} {ms('tpot_s', 'p99'):>9} {s['goodput_req_s']:>8.2f}")


def _result(cfg: CliConfig, model: str, url: str, summaries: list[dict[str, Any]],
            load_start: tuple[float, float, float]) -> dict[str, Any]:
    b = cfg.bench
    return {
        "mode": "online", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "server": {"url": url, "model": model, "api": b.api},
        "workload": {"name": b.workload, "seed": b.seed, "num_requests_cap": b.num_requests},
        "slo": {"ttft_s": b.slo_ttft_s, "tpot_s": b.slo_tpot_s},
        "rates": summaries,
        "machine": {"cpu_count": os.cpu_count(), "load_avg_start": list(load_start),
                    "load_avg_end": list(os.getloadavg())},
    }
