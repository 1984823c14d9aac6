"""Disaggregated prefill/decode against colocated layouts on a RAG-like workload, in one run.

    python -m meshserve.bench.disagg --rates 0.25 0.5 --ttft-ms 4000 --tpot-ms 60

The rag workload (prompts of 1000-2000 tokens, 64-256 new tokens) arriving as a Poisson
process at each rate, on the bench's `tiny` model, every layout on the same two cores:
  - `1P+1D`: disagg=manual, one prefill and one decode replica (one thread each);
  - `dp=2`: two colocated replicas behind the cache-aware router (one thread each);
  - `tp=2`: one replica over two ranks (one thread each);
  - `1x-auto`: one replica, two threads, engine.max_num_batched_tokens=auto with
    scenario.tpot_slo_ms the TPOT SLO (the latency-set step budget).
The SLOs are arguments, fixed before the run. Prints per rate and layout: goodput (requests
per second meeting both SLOs), TTFT and TPOT p50/p99, throughput; for 1P+1D the KV moved
(bytes, bytes/s, transfer time p50) and how the transfer compares with TTFT (the first
token comes from the prefill replica, so the transfer delays the second token, not the
first); and the ratios of 1P+1D to the best colocated layout at that rate.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from meshserve.bench import checkpoints, workloads
from meshserve.bench.harness import MeshserveRunner
from meshserve.bench.metrics import summarize
from meshserve.engine.disagg import DisaggEngine
from meshserve.engine.runtime_config import load_runtime_config
from meshserve.models.arch import ModelArch

LAYOUTS = {
    "1P+1D": ["parallel=single", "threads=1", "disagg=manual"],
    "dp=2": ["parallel=single", "threads=1", "parallel.dp=2"],
    "tp=2": ["parallel.tp=2", "threads=1"],
    "1x-auto": ["parallel=single", "threads=2", "engine.max_num_batched_tokens=auto"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--ttft-ms", type=float, default=4000.0, help="TTFT SLO")
    ap.add_argument("--tpot-ms", type=float, default=60.0, help="TPOT SLO")
    ap.add_argument("--model", default="tiny", help="a bench checkpoint or HF directory")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--connector", default="auto", choices=["auto", "nixl", "torch"])
    ap.add_argument("--prefill-step-tokens", type=int, default=512,
                    help="1P+1D's engine.max_num_batched_tokens (short prefill steps keep "
                         "the front, which runs the prefill replica, answering)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = checkpoints.resolve(args.model)
    arch = ModelArch.from_dir(path)
    base = [f"model.path='{path}'", f"model.name={args.model}", "engine.block_size=16",
            f"scenario.tpot_slo_ms={args.tpot_ms}", f"scenario.ttft_slo_ms={args.ttft_ms}"]
    print(json.dumps({"slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
                      "workload": "rag", "num_requests": args.num_requests}), flush=True)
    for i, rate in enumerate(args.rates):
        reqs = workloads.resolve("rag", arch.vocab_size, rate=rate,
                                 num_requests=args.num_requests)
        names = args.layouts if i % 2 == 0 else list(reversed(args.layouts))
        rows = {}
        for name in names:
            extra = ([f"disagg.connector={args.connector}",
                      f"engine.max_num_batched_tokens={args.prefill_step_tokens}"]
                     if name == "1P+1D" else [])
            runner = MeshserveRunner(load_runtime_config([*base, *LAYOUTS[name], *extra]),
                                     name=name)
            try:
                res = runner.run(reqs)
                engine = runner.llm.engine
                transfers = engine.transfers if isinstance(engine, DisaggEngine) else None
            finally:
                runner.llm.shutdown()
            s = summarize(res, args.ttft_ms / 1e3, args.tpot_ms / 1e3)
            row = {"goodput_req_s": round(s["goodput_req_s"], 4),
                   "tok_s": round(s["throughput_tok_s"], 1),
                   "ttft_p50_ms": round(s["ttft_s"]["p50"] * 1e3, 1),
                   "ttft_p99_ms": round(s["ttft_s"]["p99"] * 1e3, 1),
                   "tpot_p50_ms": round(s["tpot_s"]["p50"] * 1e3, 1),
                   "tpot_p99_ms": round(s["tpot_s"]["p99"] * 1e3, 1)}
            if transfers is not None and transfers.recent:
                secs = list(transfers.recent)
                row["kv"] = {"transfers": transfers.num_transfers,
                             "failed": transfers.num_failed, "bytes": transfers.bytes,
                             "wire_bytes_per_s": round(transfers.bytes
                                                       / max(transfers.wire_seconds_sum, 1e-9)),
                             "handoff_bytes_per_s": round(transfers.bytes
                                                          / transfers.seconds_sum),
                             "transfer_p50_ms": round(statistics.median(secs) * 1e3, 1),
                             "transfer_over_ttft_p50": round(
                                 statistics.median(secs) / s["ttft_s"]["p50"], 3)}
            rows[name] = row
            print(json.dumps({"rate": rate, "layout": name, **row}), flush=True)
        colocated = {n: r for n, r in rows.items() if n != "1P+1D"}
        if "1P+1D" in rows and colocated:
            pd = rows["1P+1D"]
            best = max(colocated, key=lambda n: (colocated[n]["goodput_req_s"],
                                                 -colocated[n]["tpot_p99_ms"]))
            b = colocated[best]
            print(json.dumps({"rate": rate, "best_colocated": best,
                              "tpot_p99_pd_over_best": round(pd["tpot_p99_ms"]
                                                             / b["tpot_p99_ms"], 3),
                              "goodput_pd_over_best": round(
                                  pd["goodput_req_s"] / max(b["goodput_req_s"], 1e-9), 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
