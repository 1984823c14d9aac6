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
per second meeting both SLOs), TTFT, TPOT and inter-token latency p50/p99 (as the caller
receives the tokens), throughput; for 1P+1D the KV moved
(bytes, the share read while the prompt was still computed, bytes/s, transfer time p50,
the gap between the first and the second token) and how the transfer compares with TTFT
(the first token comes from the prefill replica, so the transfer delays the second
token, not the first); and the ratios of 1P+1D to the best colocated layout at that rate (the most
requests within both SLOs, then the lowest TPOT p99). Before the run,
the planner's predicted goodput of 1P+1D, dp=2 and tp=2 on the `--cluster` preset for the
workload's mean prompt and output; each row then has the prediction at its rate (goodput
cannot exceed the offered rate) and measured / predicted. Beside it, the same layout
serving these very requests (their arrivals and lengths) simulated step by step on the
preset's cost model (parallel/planner/layout_sim.py), and measured / simulated: the
mean-request prediction cannot see the tails that SLO attainment hangs on. Before its
measured run each layout serves a burst of `--profile-requests` other rag requests (a
different seed); how much slower than the cost model priced them the engine ran that
burst (`profile_scale`) scales the simulated steps, as DistServe profiles its model
before simulating. Every layout serves the burst, so each measured run starts as warm.

With `--capacity` it searches, instead, each planned layout's capacity: the highest rate at
which ATTAINMENT (90%) of the requests meet both SLOs, on the simulation (bisected from
the planner's prediction) and on the engine (bisected from the simulated capacity; each
trial the same lengths and arrival pattern, scaled, with fresh prompt tokens), beside the
prediction itself. `--num-requests` sets how long a trial runs: near capacity the prefill
queue takes many requests to reach its steady length.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections import deque
from dataclasses import fields, replace
from typing import Any

import torch

from meshserve.bench import checkpoints, workloads
from meshserve.bench.harness import MeshserveRunner
from meshserve.bench.layout_check import load_cluster
from meshserve.bench.metrics import summarize
from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.engine.disagg.front import DisaggEngine, TransferStats
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.cluster import ClusterConfig
from meshserve.parallel.planner.disagg_search import splits
from meshserve.parallel.planner.goodput import ATTAINMENT
from meshserve.parallel.planner.layout_sim import (
    Replicas,
    profile_scale,
    simulate_colocated,
    simulate_disagg,
)
from meshserve.parallel.planner.model_shape import ModelShape
from meshserve.parallel.planner.rate_search import max_rate
from meshserve.parallel.planner.search import evaluate, options_for
from meshserve.parallel.planner.serving_sim import Attainment, SimRequest

BLOCK_SIZE = 16

LAYOUTS = {
    "1P+1D": ["parallel=single", "threads=1", "disagg=manual"],
    "dp=2": ["parallel=single", "threads=1", "parallel.dp=2"],
    "tp=2": ["parallel.tp=2", "threads=1"],
    "1x-auto": ["parallel=single", "threads=2", "engine.max_num_batched_tokens=auto"],
}


PLANNED = {"1P+1D": None, "dp=2": (1, 1, 2), "tp=2": (2, 1, 1)}
"""The layouts the planner predicts: the split, and colocated (tp, pp, dp); 1x-auto (one
replica on two threads) is no layout of its devices."""


def bench_shape(arch: ModelArch, kv_dtype: str, weight_dtype: str = "auto") -> ModelShape:
    """The cost model's view of the bench's fp32 CPU model over its KV cache's and its
    weights' dtypes (auto: fp32)."""
    return ModelShape.from_arch(arch, "float32", None if kv_dtype == "auto" else kv_dtype,
                                None if weight_dtype == "auto" else weight_dtype)


def predicted_goodput(arch: ModelArch, reqs: list, ttft_ms: float, tpot_ms: float,
                      cluster: ClusterConfig, prefill_step_tokens: int,
                      kv_dtype: str = "auto", weight_dtype: str = "auto",
                      streamed: bool = False) -> dict[str, float]:
    """The planner's goodput (req/s) of each planned layout on `cluster`, for the workload's
    mean prompt and output and the bench's SLOs; no prefix is shared. Steps carry what the
    layouts' engines do: the split's `prefill_step_tokens`, the colocated engine's default;
    `streamed`: the split reads each prompt's KV as it is computed."""
    config = load_runtime_config()
    prompt = round(statistics.mean(len(r.prompt_token_ids) for r in reqs))
    output = round(statistics.mean(r.max_new_tokens for r in reqs))
    scenario = replace(config.scenario, name="rag-bench", objective="throughput",
                       prompt_len=prompt, output_len=output, shared_prefix_fraction=0.0,
                       ttft_slo_ms=ttft_ms, tpot_slo_ms=tpot_ms, max_batch=len(reqs))
    shape = bench_shape(arch, kv_dtype, weight_dtype)
    split = replace(options_for(config), max_num_batched_tokens=prefill_step_tokens,
                    streamed_hop=streamed)
    colocated = replace(split, max_num_batched_tokens=config.engine.step_token_cap)
    out = {}
    for name, degrees in PLANNED.items():
        if degrees is None:
            found = [c for c in splits(shape, cluster, scenario, split)
                     if c.rejected is None and c.prefill.devices == c.decode.devices == 1]
            pred = found[0].prediction if found else None
        else:
            pred = evaluate(shape, cluster, scenario, degrees, colocated).prediction
        if pred is not None:
            out[name] = pred.goodput_req_s
    return out


class Simulated:
    """The planned layouts serving given requests (their arrivals and lengths), simulated
    step by step on the planner's cost model for `cluster`, sized for the measured
    workload."""

    def __init__(self, arch: ModelArch, reqs: list, ttft_ms: float, tpot_ms: float,
                 cluster: ClusterConfig, prefill_step_tokens: int, kv_dtype: str = "auto",
                 weight_dtype: str = "auto", streamed: bool = False) -> None:
        config = load_runtime_config()
        self.shape = bench_shape(arch, kv_dtype, weight_dtype)
        self.cluster = cluster
        self.scenario = replace(
            config.scenario, name="rag-bench", shared_prefix_fraction=0.0,
            prompt_len=max(len(r.prompt_token_ids) for r in reqs),
            output_len=max(r.max_new_tokens for r in reqs), max_batch=len(reqs),
            ttft_slo_ms=ttft_ms, tpot_slo_ms=tpot_ms)
        self.options = replace(options_for(config), max_num_batched_tokens=prefill_step_tokens,
                               streamed_hop=streamed)
        self.budget = config.engine.step_token_cap
        self.prefill_step_tokens = prefill_step_tokens

    def run(self, name: str, reqs: list, scale: float = 1.0) -> Attainment | None:
        """Layout `name` (one of PLANNED) serving `reqs`, its steps at `scale` times the
        cost model's price; None where the planner's sizing rejects it."""
        sim = [SimRequest(r.arrival_s, len(r.prompt_token_ids), r.max_new_tokens)
               for r in reqs]
        args = (self.shape, self.cluster, self.scenario, self.options)
        degrees = PLANNED[name]
        if degrees is None:  # the split runs with --prefill-step-tokens on both sides
            side = Replicas(budget=self.prefill_step_tokens)
            return simulate_disagg(*args, side, side, sim, scale)
        tp, pp, dp = degrees
        return simulate_colocated(*args, Replicas(tp, pp, dp, self.budget), sim, scale)


CAPACITY_TOL = 0.15
"""The capacity search stops once a served and an unserved rate lie within this ratio."""
CAPACITY_SPAN = 0.125
"""It looks no further than this factor of the prediction either way."""


def search_capacity(name: str, base: list[str], args: argparse.Namespace, arch: ModelArch,
                    cluster: ClusterConfig, profile: list | None,
                    predicted: float | None) -> dict[str, Any]:
    """Layout `name`'s capacity: the highest rate at which at least ATTAINMENT of the
    requests meet both SLOs, simulated on the cost model (its steps scaled by the profile
    burst, as in the rate runs) and bisected from the planner's prediction, then measured
    on the engine (each trial the same requests at a scaled Poisson process) and bisected
    from the simulated capacity."""
    def at(rate: float, trial: int = 0) -> list:
        """The workload at `rate`; a trial's prompts are fresh tokens of the same lengths
        (the rag prompts share nothing), so no trial hits what an earlier one cached."""
        reqs = workloads.resolve("rag", arch.vocab_size, rate=rate,
                                 num_requests=args.num_requests)
        gen = torch.Generator().manual_seed(1000 + trial)
        return [replace(r, prompt_token_ids=torch.randint(
                    0, arch.vocab_size, (len(r.prompt_token_ids),), generator=gen).tolist())
                for r in reqs] if trial else reqs

    extra = split_overrides(args) if name == "1P+1D" else []
    runner = MeshserveRunner(load_runtime_config([*base, *LAYOUTS[name], *extra]), name=name)
    sims = Simulated(arch, at(1.0), args.ttft_ms, args.tpot_ms, cluster,
                     args.prefill_step_tokens, args.kv_cache_dtype,
                     args.cpu_weight_dtype, streams(args))
    trials: list[dict[str, Any]] = []
    guess = predicted or 0.5
    try:
        scale = 1.0
        if profile:
            priced = sims.run(name, profile)
            scale = profile_scale(runner.run(profile).wall_s, priced) if priced else 1.0

        def simulated(rate: float) -> bool:
            sim = sims.run(name, at(rate), scale)
            return sim is not None and sim.num_good >= ATTAINMENT * args.num_requests

        sim_found = max_rate(simulated, guess, rel_tol=CAPACITY_TOL / 3, floor=CAPACITY_SPAN)

        def measured(rate: float) -> bool:
            s = summarize(runner.run(at(rate, len(trials) + 1)), args.ttft_ms / 1e3,
                          args.tpot_ms / 1e3)
            good = round(s["goodput_req_s"] * s["wall_s"])
            trials.append({"rate": round(rate, 4), "num_within_slo": good})
            print(json.dumps({"layout": name, **trials[-1]}), flush=True)
            return good >= ATTAINMENT * args.num_requests

        found = max_rate(measured, sim_found or guess, rel_tol=CAPACITY_TOL,
                         floor=CAPACITY_SPAN)
    finally:
        runner.llm.shutdown()
    return {"layout": name, "measured_capacity_req_s": round(found, 4),
            "predicted_goodput_req_s": round(predicted, 4) if predicted else None,
            "predicted_over_measured": round(predicted / found, 3)
            if predicted and found else None,
            "simulated_capacity_req_s": round(sim_found, 4),
            "simulated_over_measured": round(sim_found / found, 3) if found else None,
            "profile_scale": round(scale, 3), "trials": trials}


def best_colocated(rows: dict[str, dict[str, Any]]) -> str:
    """The colocated layout 1P+1D is held against: the most requests within both SLOs,
    then the lowest TPOT p99. (Goodputs of layouts that serve the same requests differ
    only by when their last request ended.)"""
    return max(rows, key=lambda n: (rows[n]["num_within_slo"], -rows[n]["tpot_p99_ms"]))


def split_overrides(args: argparse.Namespace) -> list[str]:
    """1P+1D's own settings: how KV moves, and its prefill steps."""
    return [f"disagg.connector={args.connector}", f"disagg.stream_kv={args.stream_kv}",
            f"disagg.torch_shm={args.torch_shm}", f"disagg.torch_wire={args.torch_wire}",
            f"engine.max_num_batched_tokens={args.prefill_step_tokens}"]


def streams(args: argparse.Namespace) -> bool:
    """Whether the split the bench starts reads prompts' KV as it is computed."""
    return args.stream_kv == "true"


def handoff_gaps(records: list[Any]) -> dict[str, float]:
    """p50 and p99 of the wait between each request's first token (the prefill replica's)
    and its second (the decode replica's, once the KV has moved), in ms."""
    gaps = sorted(r.itl[0] for r in records if r.itl)
    if not gaps:
        return {}
    return {"handoff_gap_p50_ms": round(statistics.median(gaps) * 1e3, 1),
            "handoff_gap_p99_ms": round(gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
                                        * 1e3, 1)}


def since(now: TransferStats, before: TransferStats) -> TransferStats:
    """The KV transfers counted after `before` was taken (the measured run's alone)."""
    def minus(a: Any, b: Any) -> Any:
        if isinstance(a, list) and isinstance(b, list):
            return [x - y for x, y in zip(a, b, strict=True)]
        return a - b

    counts: dict[str, Any] = {f.name: minus(getattr(now, f.name), getattr(before, f.name))
                              for f in fields(TransferStats) if f.name != "recent"}
    return TransferStats(**counts,
                         recent=deque(list(now.recent)[len(before.recent):], maxlen=4096))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--ttft-ms", type=float, default=4000.0, help="TTFT SLO")
    ap.add_argument("--tpot-ms", type=float, default=60.0, help="TPOT SLO")
    ap.add_argument("--model", default="tiny", help="a bench checkpoint or HF directory")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--connector", default="auto", choices=["auto", "nixl", "torch"])
    ap.add_argument("--stream-kv", default="true", choices=["true", "false"],
                    help="1P+1D's disagg.stream_kv: read each prompt's blocks as they are "
                         "computed, or all after its first token")
    ap.add_argument("--torch-shm", default="true", choices=["true", "false"],
                    help="1P+1D's disagg.torch_shm: the torch connector through shared "
                         "memory on one host, or through its wire")
    ap.add_argument("--torch-wire", default="auto",
                    choices=["auto", "gloo", "gloo_pairs", "nccl"],
                    help="1P+1D's disagg.torch_wire: the torch connector's torch.distributed "
                         "wire")
    ap.add_argument("--prefill-step-tokens", type=int, default=None,
                    help="1P+1D's engine.max_num_batched_tokens (default: the engine's, as "
                         "the colocated layouts run)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="every layout's engine.kv_cache_dtype (auto: the model's, float32)")
    ap.add_argument("--cpu-weight-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="every layout's model.cpu_weight_dtype (auto: float32)")
    ap.add_argument("--cluster", default="local-cpu",
                    help="the cluster preset the planner predicts with: a name in conf/cluster "
                         "or a YAML file `meshserve calibrate calibrate.out=F` wrote")
    ap.add_argument("--capacity", action="store_true",
                    help="instead of the rates: search each planned layout's capacity, the "
                         "highest rate at which ATTAINMENT of the requests meet both SLOs, "
                         "measured and simulated, beside the planner's predicted goodput")
    ap.add_argument("--profile-requests", type=int, default=4,
                    help="a burst of this many other rag requests each layout serves before "
                         "the measured run: the simulation's steps are scaled by how much "
                         "slower than the cost model's price the engine ran it (0: none)")
    args = ap.parse_args()
    if args.prefill_step_tokens is None:
        args.prefill_step_tokens = load_runtime_config().engine.step_token_cap
    torch.set_num_threads(1)
    path = checkpoints.resolve(args.model)
    arch = ModelArch.from_dir(path)
    base = [f"model.path='{path}'", f"model.name={args.model}", f"engine.block_size={BLOCK_SIZE}",
            f"scenario.tpot_slo_ms={args.tpot_ms}", f"scenario.ttft_slo_ms={args.ttft_ms}",
            f"engine.kv_cache_dtype={args.kv_cache_dtype}",
            f"model.cpu_weight_dtype={args.cpu_weight_dtype}"]
    print(json.dumps({"slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms},
                      "workload": "rag", "num_requests": args.num_requests,
                      "kv_cache_dtype": args.kv_cache_dtype,
                      "cpu_weight_dtype": args.cpu_weight_dtype}), flush=True)
    reqs = workloads.resolve("rag", arch.vocab_size, rate=args.rates[0],
                             num_requests=args.num_requests)
    cluster = load_cluster(args.cluster)
    profile = (workloads.resolve("rag", arch.vocab_size, seed=1,
                                 num_requests=args.profile_requests)
               if args.profile_requests > 0 else None)
    planned = predicted_goodput(arch, reqs, args.ttft_ms, args.tpot_ms, cluster,
                                args.prefill_step_tokens, args.kv_cache_dtype,
                                args.cpu_weight_dtype, streams(args))
    print(json.dumps({"predicted_goodput_req_s": {n: round(g, 4) for n, g in planned.items()},
                      "cluster": cluster.name, "cluster_source": cluster.source}), flush=True)
    if args.capacity:
        for name in (n for n in args.layouts if n in PLANNED):
            print(json.dumps(search_capacity(name, base, args, arch, cluster, profile,
                                             planned.get(name))), flush=True)
        return
    for i, rate in enumerate(args.rates):
        reqs = workloads.resolve("rag", arch.vocab_size, rate=rate,
                                 num_requests=args.num_requests)
        sims = Simulated(arch, reqs, args.ttft_ms, args.tpot_ms, cluster,
                         args.prefill_step_tokens, args.kv_cache_dtype,
                         args.cpu_weight_dtype, streams(args))
        names = args.layouts if i % 2 == 0 else list(reversed(args.layouts))
        rows = {}
        for name in names:
            extra = split_overrides(args) if name == "1P+1D" else []
            runner = MeshserveRunner(load_runtime_config([*base, *LAYOUTS[name], *extra]),
                                     name=name)
            try:
                scale = None
                if profile:  # a burst of other requests first: the engine's own pace
                    measured = runner.run(profile).wall_s
                    priced = sims.run(name, profile) if name in PLANNED else None
                    scale = profile_scale(measured, priced) if priced is not None else None
                engine = runner.llm.engine
                disagg = isinstance(engine, DisaggEngine)
                before = copy.deepcopy(engine.transfers) if disagg else None
                res = runner.run(reqs)
                transfers = since(engine.transfers, before) if disagg else None
            finally:
                runner.llm.shutdown()
            s = summarize(res, args.ttft_ms / 1e3, args.tpot_ms / 1e3)
            row = {"goodput_req_s": round(s["goodput_req_s"], 4),
                   "num_within_slo": round(s["goodput_req_s"] * s["wall_s"]),
                   "tok_s": round(s["throughput_tok_s"], 1),
                   "ttft_p50_ms": round(s["ttft_s"]["p50"] * 1e3, 1),
                   "ttft_p99_ms": round(s["ttft_s"]["p99"] * 1e3, 1),
                   "tpot_p50_ms": round(s["tpot_s"]["p50"] * 1e3, 1),
                   "tpot_p99_ms": round(s["tpot_s"]["p99"] * 1e3, 1),
                   "itl_p50_ms": round(s["itl_s"]["p50"] * 1e3, 1),
                   "itl_p99_ms": round(s["itl_s"]["p99"] * 1e3, 1)}
            if transfers is not None and transfers.recent:
                secs = list(transfers.recent)
                row["kv"] = {"transfers": transfers.num_transfers,
                             "failed": transfers.num_failed, "bytes": transfers.bytes,
                             "streamed_share": round(transfers.bytes_streamed
                                                     / max(transfers.bytes, 1), 3),
                             "layered_share": round(transfers.bytes_layered
                                                    / max(transfers.bytes, 1), 3),
                             "wire_bytes_per_s": round(transfers.bytes
                                                       / max(transfers.wire_seconds_sum, 1e-9)),
                             "handoff_bytes_per_s": round(transfers.bytes
                                                          / transfers.seconds_sum),
                             "transfer_p50_ms": round(statistics.median(secs) * 1e3, 1),
                             **handoff_gaps(res.records),
                             "transfer_over_ttft_p50": round(
                                 statistics.median(secs) / s["ttft_s"]["p50"], 3)}
            if name in planned:  # goodput cannot exceed the offered rate
                expect = min(rate, planned[name])
                row["predicted_goodput_req_s"] = round(expect, 4)
                row["measured_over_predicted"] = round(row["goodput_req_s"] / expect, 3) \
                    if expect else None
            sim = sims.run(name, reqs, scale or 1.0) if name in PLANNED else None
            if sim is not None:  # these very requests, stepped on the cost model
                g = sim.goodput_req_s
                if scale is not None:
                    row["profile_scale"] = round(scale, 3)
                row["simulated_goodput_req_s"] = round(g, 4)
                row["measured_over_simulated"] = round(row["goodput_req_s"] / g, 3) if g else None
            rows[name] = row
            print(json.dumps({"rate": rate, "layout": name, **row}), flush=True)
        colocated = {n: r for n, r in rows.items() if n != "1P+1D"}
        if "1P+1D" in rows and colocated:
            pd = rows["1P+1D"]
            best = best_colocated(colocated)
            b = colocated[best]
            print(json.dumps({"rate": rate, "best_colocated": best,
                              "tpot_p99_pd_over_best": round(pd["tpot_p99_ms"]
                                                             / b["tpot_p99_ms"], 3),
                              "goodput_pd_over_best": round(
                                  pd["goodput_req_s"] / max(b["goodput_req_s"], 1e-9), 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
