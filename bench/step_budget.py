"""The automatic step budget against the fixed one, online, in one run.

    python -m meshserve.bench.step_budget --rates 1 2 4 --tpot-ms 40

The longtail workload (prompts 32-512 tokens, outputs 8-256) arriving as a Poisson
process at each rate, on the bench's `tiny` model, one rank, one thread: meshserve with
engine.max_num_batched_tokens=2048 and with =auto (scenario.tpot_slo_ms the TPOT target),
the two alternating which goes first at each rate. Prints, per rate and budget, generated
tokens/s, TPOT p50/p99 (each request's mean time per output token), inter-token latency
p50/p99 (every gap between a request's outputs: the stalls a stream shows) and TTFT
p50/p99, and the ratios of auto to fixed.
"""

from __future__ import annotations

import argparse
import json

import torch

from meshserve.bench import checkpoints, workloads
from meshserve.bench.harness import MeshserveRunner
from meshserve.bench.metrics import summarize
from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.models.arch import ModelArch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--tpot-ms", type=float, default=40.0, help="scenario.tpot_slo_ms")
    ap.add_argument("--model", default="tiny", help="a bench checkpoint or HF directory")
    ap.add_argument("--num-requests", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = checkpoints.resolve(args.model)
    arch = ModelArch.from_dir(path)
    base = [f"model.path='{path}'", f"model.name={args.model}", "parallel=single",
            f"scenario.tpot_slo_ms={args.tpot_ms}"]
    runners = {budget: MeshserveRunner(load_runtime_config(
        [*base, f"engine.max_num_batched_tokens={budget}"]), name=f"budget={budget}")
        for budget in ("2048", "auto")}
    slo = args.tpot_ms / 1e3
    try:
        for i, rate in enumerate(args.rates):
            reqs = workloads.resolve("online", arch.vocab_size, rate=rate,
                                     num_requests=args.num_requests)
            order = list(runners) if i % 2 == 0 else list(reversed(runners))
            rows = {}
            for budget in order:
                s = summarize(runners[budget].run(reqs), 60.0, slo)
                rows[budget] = {"tok_s": round(s["throughput_tok_s"], 1),
                                "tpot_p50_ms": round(s["tpot_s"]["p50"] * 1e3, 1),
                                "tpot_p99_ms": round(s["tpot_s"]["p99"] * 1e3, 1),
                                "itl_p50_ms": round(s["itl_s"]["p50"] * 1e3, 1),
                                "itl_p99_ms": round(s["itl_s"]["p99"] * 1e3, 1),
                                "ttft_p50_ms": round(s["ttft_s"]["p50"] * 1e3, 1),
                                "ttft_p99_ms": round(s["ttft_s"]["p99"] * 1e3, 1)}
            fixed, auto = rows["2048"], rows["auto"]
            print(json.dumps({"rate": rate, "tpot_target_ms": args.tpot_ms, "fixed": fixed,
                              "auto": auto,
                              "tpot_p99_auto_over_fixed": round(
                                  auto["tpot_p99_ms"] / fixed["tpot_p99_ms"], 3),
                              "itl_p99_auto_over_fixed": round(
                                  auto["itl_p99_ms"] / fixed["itl_p99_ms"], 3),
                              "tok_s_auto_over_fixed": round(auto["tok_s"] / fixed["tok_s"],
                                                             3)}), flush=True)
    finally:
        for r in runners.values():
            r.llm.shutdown()


if __name__ == "__main__":
    main()
