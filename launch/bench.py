"""`meshserve bench`: a benchmark workload (docs/benchmarks/README.md) on meshserve and its peers, side by side.

    meshserve bench bench.model=tiny bench.workload=longtail \\
        bench.peers=[hf-static-8,hf-static-16,hf-continuous] bench.repeats=3 bench.out=DIR

One thread per engine (`threads`, default 1), the machine's roofline first, one warm-up
run per engine, then `bench.repeats` rounds in rotating order; writes DIR/result.json and
DIR/result.png and prints a table with meshserve's ratios against each peer.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import torch

from meshserve.bench import checkpoints, roofline, workloads
from meshserve.bench.harness import MeshserveRunner, Runner
from meshserve.bench.peer_names import MESHSERVE, MESHSERVE_SINGLE
from meshserve.bench.peers import load_hf_model, make_peer
from meshserve.bench.plot import plot
from meshserve.bench.report import build_result, table, write_json
from meshserve.bench.rounds import check_outputs, run_rounds
from meshserve.launch.cli_config import load_config
from meshserve.launch.options import CliConfig
from meshserve.models.arch import ModelArch
from meshserve.models.bundled import resolve_model_dir


def run(overrides: list[str]) -> int:
    """Run the configured comparison; returns the exit code."""
    cfg = _config(overrides)
    if cfg.bench.url is not None:  # online mode: a running server, over HTTP
        from meshserve.launch.bench_online import run_online

        return run_online(cfg)
    b = cfg.bench
    threads = cfg.threads or 1  # one compute thread per process unless told (the benchmark protocol)
    torch.set_num_threads(threads)
    model_dir = resolve_model_dir(cfg.model.name, cfg.model.path)
    arch = ModelArch.from_dir(model_dir)
    reqs = workloads.resolve(b.workload, arch.vocab_size, seed=b.seed,
                             num_requests=b.num_requests, rate=b.rate)
    _check_fits(reqs, cfg, arch)
    load_start = os.getloadavg()
    roof = roofline.measure(b.roofline_read_bytes, b.roofline_matmul_size) if b.roofline else None
    ours = MeshserveRunner(cfg)
    itemsize = ours.dtype.itemsize
    runners: list[Runner] = [ours]
    try:
        runners += _peers(cfg, model_dir, ours.dtype)
        rounds = run_rounds(runners, reqs, repeats=b.repeats, warmup=b.warmup,
                            progress=b.progress)
    finally:  # multi-rank runs: every rank exits cleanly, its ports freed
        for r in runners:
            if isinstance(r, MeshserveRunner):
                r.llm.shutdown()
    meta = _meta(cfg, model_dir, arch, itemsize, reqs, load_start)
    result = build_result(rounds=rounds, checks=check_outputs(rounds, MESHSERVE), arch=arch,
                          itemsize=itemsize, roof=roof, threads=threads,
                          slo=(b.slo_ttft_s, b.slo_tpot_s), meta=meta)
    out = Path(b.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    written = [write_json(result, out / "result.json")]
    if b.plot:
        written.append(plot(result, out / "result.png"))
    print(_header(result))
    print(table(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _config(overrides: list[str]) -> CliConfig:
    """The config; bench.model builds (or finds) a benchmark checkpoint and points model.path at it."""
    cfg = load_config(overrides)
    if cfg.bench.model is None:
        return cfg
    if cfg.model.path is not None:
        raise ValueError(f"bench.model={cfg.bench.model!r} and model.path={cfg.model.path!r} "
                         "both given: allowed is one of them")
    path = checkpoints.resolve(cfg.bench.model, cfg.bench.cache_dir)
    return load_config([*overrides, f"model.path='{path}'", f"model.name={cfg.bench.model}"])


def _check_fits(reqs: list[workloads.BenchRequest], cfg: CliConfig, arch: ModelArch) -> None:
    limit = cfg.engine.max_model_len or arch.max_position_embeddings
    for i, r in enumerate(reqs):
        if len(r.prompt_token_ids) + r.max_new_tokens > limit:
            raise ValueError(f"bench.workload={cfg.bench.workload!r}: request {i} needs "
                             f"{len(r.prompt_token_ids)} + {r.max_new_tokens} tokens; allowed is "
                             f"at most max_model_len={limit}")


def _peers(cfg: CliConfig, model_dir: Path, dtype: torch.dtype) -> list[Runner]:
    """The configured peers in their order: meshserve-single (our engine on one rank, in
    this process) and the transformers ones, sharing one model in meshserve's dtype."""
    hf = [p for p in cfg.bench.peers if p != MESHSERVE_SINGLE]
    model = load_hf_model(model_dir, dtype) if hf else None
    peers: list[Runner] = []
    for name in cfg.bench.peers:
        if name == MESHSERVE_SINGLE:
            single = dataclasses.replace(cfg.parallel, tp=1, pp=1, dp=1, auto=False)
            peers.append(MeshserveRunner(dataclasses.replace(cfg, parallel=single), name=name))
        else:
            assert model is not None
            peers.append(make_peer(name, model, max_batch_tokens=cfg.bench.hf_max_batch_tokens,
                                   kv_cache_memory=cfg.engine.kv_cache_memory))
    return peers


def _meta(cfg: CliConfig, model_dir: Path, arch: ModelArch, itemsize: int,
          reqs: list[workloads.BenchRequest], load_start: tuple[float, float, float]
          ) -> dict[str, Any]:
    import transformers

    b = cfg.bench
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workload": {"name": b.workload, "num_requests": len(reqs), "seed": b.seed,
                     "num_requests_cap": b.num_requests, "rate_req_s": b.rate,
                     "num_prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
                     "num_max_new_tokens": sum(r.max_new_tokens for r in reqs),
                     "last_arrival_s": max(r.arrival_s for r in reqs)},
        "model": {"name": model_dir.name if cfg.model.path else cfg.model.name,
                  "path": str(model_dir), "num_params": arch.num_params,
                  "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_hidden_layers,
                  "vocab_size": arch.vocab_size, "itemsize": itemsize,
                  "weight_bytes_read_per_step": roofline.weight_bytes_read(arch, itemsize),
                  "kv_bytes_per_token": roofline.kv_bytes_per_token(arch, itemsize)},
        "engine_config": dataclasses.asdict(cfg.engine),
        "peer_config": {"peers": list(b.peers), "hf_max_batch_tokens": b.hf_max_batch_tokens,
                        "hf_kv_cache_memory": cfg.engine.kv_cache_memory},
        "slo": {"ttft_s": b.slo_ttft_s, "tpot_s": b.slo_tpot_s},
        "machine": {"cpu_count": os.cpu_count(), "load_avg_start": list(load_start),
                    "load_avg_end": list(os.getloadavg()), "torch": torch.__version__,
                    "transformers": transformers.__version__},
    }


def _header(result: dict[str, Any]) -> str:
    w, m, roof = result["workload"], result["machine"], result["roofline"]
    line = (f"=== bench {w['name']}: {w['num_requests']} requests, {w['num_prompt_tokens']} prompt"
            f" + {w['num_max_new_tokens']} new tokens on {result['model']['name']}, "
            f"{m['threads']} thread(s); load average {m['load_avg_start'][0]:.1f} -> "
            f"{m['load_avg_end'][0]:.1f} on {m['cpu_count']} CPUs")
    if roof:
        line += (f"\n    roofline: read {roof['read_bandwidth_gbs']:.1f} GB/s, fp32 matmul "
                 f"{roof['matmul_gflops']:.1f} GFLOP/s")
    return line
