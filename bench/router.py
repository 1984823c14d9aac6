"""The data-parallel routers on a multi-tenant prefix workload, in one run.

    python -m meshserve.bench.router --rate 4 --blocks 160

The multi-tenant workload (8 system prompts of 300-600 tokens, 256 questions of 16-64
tokens after a tenant drawn at random, 16 new tokens each) arriving as a Poisson process,
on the bench's `tiny` model at parallel.dp=2 (one thread per replica), once per router:
cache_aware, least_loaded, round_robin. Each replica's KV cache has --blocks blocks of 16
tokens: by default about five system prompts' worth, so a replica that sees every tenant
must evict, and one that sees half of them need not. Prints, per router, the prefix-cache
hit rate (prompt blocks found cached over those looked up), TTFT p50/p99, throughput, the
requests each replica got, the router's time per request (its `pick` and the prompt's
block hashing, wherever it happens; timed here so an older checkout is timed alike), and
the ratios to
least_loaded. `--routers` runs some of them only.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from meshserve.bench import checkpoints, workloads
from meshserve.bench.harness import MeshserveRunner
from meshserve.bench.metrics import summarize
from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.engine.replicas.router import Router
from meshserve.models.arch import ModelArch

ROUTERS = ("cache_aware", "least_loaded", "round_robin")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=4.0, help="requests/s")
    ap.add_argument("--blocks", type=int, default=160, help="KV blocks per replica")
    ap.add_argument("--model", default="tiny", help="a bench checkpoint or HF directory")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    args = ap.parse_args()
    picks: list[float] = []
    Router.pick = _timed(Router.pick, picks)  # type: ignore[method-assign]
    hashing: list[float] = []  # a checkout that hashes the prompt before `pick`
    if hasattr(Router, "chain"):
        Router.chain = _timed(Router.chain, hashing)  # type: ignore[method-assign]
    torch.set_num_threads(1)
    path = checkpoints.resolve(args.model)
    arch = ModelArch.from_dir(path)
    reqs = workloads.poisson(workloads.multi_tenant(arch.vocab_size, n=args.num_requests),
                             args.rate)
    base = [f"model.path='{path}'", f"model.name={args.model}", "parallel=single",
            "parallel.dp=2", "engine.block_size=16", f"engine.num_gpu_blocks={args.blocks}"]
    rows = {}
    for router in args.routers:
        picks.clear()
        hashing.clear()
        runner = MeshserveRunner(load_runtime_config([*base, f"parallel.router={router}"]),
                                 name=router)
        try:
            res = runner.run(reqs)
            per_replica = list(runner.llm.engine.requests_per_replica)
        finally:
            runner.llm.shutdown()
        s = summarize(res, 60.0, 60.0)
        rows[router] = {
            "hit_rate": round(res.extra["prefix_cache_hits"]
                              / max(res.extra["prefix_cache_queries"], 1), 3),
            "ttft_p50_ms": round(s["ttft_s"]["p50"] * 1e3, 1),
            "ttft_p99_ms": round(s["ttft_s"]["p99"] * 1e3, 1),
            "tok_s": round(s["throughput_tok_s"], 1),
            "prefill_tokens_computed": res.extra["prefill_tokens_computed"],
            "requests_per_replica": per_replica,
            "router_us_per_request": round((sum(picks) + sum(hashing))
                                           / max(len(picks), 1) * 1e6, 1)}
        print(json.dumps({"router": router, **rows[router]}), flush=True)
    if "least_loaded" not in rows:
        return
    ll = rows["least_loaded"]
    print(json.dumps({"rate": args.rate, "blocks_per_replica": args.blocks,
                      "vs_least_loaded": {r: {
                          "hit_rate": round(v["hit_rate"] / max(ll["hit_rate"], 1e-9), 3),
                          "ttft_p50": round(v["ttft_p50_ms"] / ll["ttft_p50_ms"], 3),
                          "ttft_p99": round(v["ttft_p99_ms"] / ll["ttft_p99_ms"], 3)}
                          for r, v in rows.items()}}), flush=True)


def _timed(pick: Callable[..., int], seconds: list[float]) -> Callable[..., int]:
    """`pick`, appending each call's seconds to `seconds`."""
    def timed(*args: Any, **kwargs: Any) -> int:
        t0 = time.perf_counter()
        try:
            return pick(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)
    return timed


if __name__ == "__main__":
    main()
