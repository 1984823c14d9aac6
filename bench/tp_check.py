"""Tensor parallelism on this CPU host against DeepSpeed-Inference, in one run.

    python -m meshserve.bench.tp_check --model big [--tp 2] [--out result.json]

Engines, one after the other, one torch thread per rank:
- meshserve TP=1 (one process), the reference of the speed-ups and of the outputs;
- meshserve TP=N (ranks spawned by `LLM`; shared-memory AllReduce unless told otherwise);
- DeepSpeed-Inference TP=N (`torchrun ... -m meshserve.bench.deepspeed_tp`);
- transformers `generate` in one process (optional, `--hf`).
Each runs the cases of `bench/tp_cases.py` (512-token TTFT, batch-1 and batch-32 decode),
greedy. The table gives each engine's median seconds, its speed-up over meshserve TP=1 and
how many of its generated tokens equal meshserve TP=1's.
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

import torch

from meshserve.bench.checkpoints import resolve
from meshserve.bench.harness import MeshserveRunner
from meshserve.bench.tp_cases import (
    CASE_NAMES,
    Case,
    CaseResult,
    make_cases,
    select_cases,
    warmup_case,
)
from meshserve.bench.workloads import BenchRequest
from meshserve.engine.config.runtime_config import load_runtime_config
from meshserve.engine.llm import model_overrides


def run_meshserve(model_dir: Path, overrides: list[str], cases: list[Case],
                  repeats: int) -> list[CaseResult]:
    """The cases on meshserve's engine; decode cases time the decode-only steps."""
    config = load_runtime_config(model_overrides(str(model_dir)) + overrides)
    runner = MeshserveRunner(config)
    try:
        results = []
        warm = warmup_case(runner.llm.engine.arch.vocab_size)
        runner.run([BenchRequest(p, warm.max_new_tokens) for p in warm.prompts])
        for case in cases:
            reqs = [BenchRequest(p, case.max_new_tokens) for p in case.prompts]
            result = CaseResult(case.name, case.metric)
            for _ in range(repeats):
                run = runner.run(reqs)
                result.token_ids = [r.token_ids for r in run.records]
                if case.metric == "ttft_s":
                    rec = run.records[0]
                    assert rec.first_token is not None
                    result.seconds.append(rec.first_token - rec.arrival)
                else:
                    result.seconds.append(run.extra["decode_steps"]["median_step_s"])
            results.append(result)
        return results
    finally:
        runner.llm.shutdown()


def run_deepspeed(model_dir: Path, tp: int, threads: int, repeats: int,
                  decode_tokens: int, cases: str) -> list[CaseResult]:
    """The cases on DeepSpeed-Inference TP=`tp` under torchrun."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "deepspeed.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={tp}", "-m", "meshserve.bench.deepspeed_tp",
               "--model", str(model_dir), "--out", str(out), "--threads", str(threads),
               "--repeats", str(repeats), "--decode-tokens", str(decode_tokens),
               "--cases", cases]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"DeepSpeed TP={tp} failed (exit {proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        data = json.loads(out.read_text())
    return [CaseResult(**c) for c in data["cases"]]


def run_transformers(model_dir: Path, cases: list[Case], repeats: int) -> list[CaseResult]:
    """The cases on transformers `generate` in this process."""
    from meshserve.bench.deepspeed_tp import run_cases
    from meshserve.bench.peers import load_hf_model

    return run_cases(load_hf_model(model_dir, torch.float32), cases, repeats)


def equal_tokens(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(equal, total): generated tokens of `b` equal to `a`'s, up to each row's first
    difference (after a difference the two continue from different text)."""
    equal = total = 0
    for ra, rb in zip(a, b):
        total += len(ra)
        for x, y in zip(ra, rb):
            if x != y:
                break
            equal += 1
    return equal, total


def table(results: dict[str, list[CaseResult]], reference: str) -> str:
    """Markdown: per case and engine, the median seconds, speed-up and equal tokens."""
    ref = {r.name: r for r in results[reference]}
    lines = ["| case | engine | median | vs meshserve TP=1 | tokens equal to TP=1 |",
             "|---|---|---|---|---|"]
    for case in ref:
        base = statistics.median(ref[case].seconds)
        for engine, rs in results.items():
            r = next(x for x in rs if x.name == case)
            med = statistics.median(r.seconds)
            eq, tot = equal_tokens(ref[case].token_ids, r.token_ids)
            lines.append(f"| {case} ({r.metric}) | {engine} | {med * 1e3:.1f} ms | "
                         f"x{base / med:.2f} | {eq}/{tot} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the engines, print the table, optionally write JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="big", help="'tiny', 'big' or a model directory")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--cases", default=",".join(CASE_NAMES),
                        help="comma-separated cases to run")
    parser.add_argument("--allreduce", default="auto", choices=["auto", "gloo"],
                        help="meshserve's parallel.cpu_allreduce")
    parser.add_argument("--hf", action="store_true", help="also transformers, one process")
    parser.add_argument("--skip", default="", help="comma-separated engines to leave out: "
                        "tp1, tpN, deepspeed")
    parser.add_argument("--out", help="write every result as JSON here")
    args = parser.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    torch.set_num_threads(args.threads)
    model_dir = resolve(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    cases = select_cases(make_cases(vocab, args.decode_tokens), args.cases)
    common = [f"threads={args.threads}", "device=cpu", "model.dtype=float32",
              "engine.max_num_batched_tokens=4096"]
    results: dict[str, list[CaseResult]] = {}
    reference = "meshserve TP=1"
    if "tp1" not in skip:
        results[reference] = run_meshserve(model_dir, common + ["parallel.tp=1"], cases,
                                           args.repeats)
    else:
        reference = f"meshserve TP={args.tp}"
    if "tpN" not in skip:
        results[f"meshserve TP={args.tp}"] = run_meshserve(
            model_dir, common + [f"parallel.tp={args.tp}",
                                 f"parallel.cpu_allreduce={args.allreduce}"],
            cases, args.repeats)
    if "deepspeed" not in skip:
        results[f"DeepSpeed TP={args.tp}"] = run_deepspeed(
            model_dir, args.tp, args.threads, args.repeats, args.decode_tokens, args.cases)
    if args.hf:
        results["transformers, 1 process"] = run_transformers(model_dir, cases, args.repeats)
    print(f"model {args.model}, {args.threads} thread(s) per rank, {args.repeats} repeats")
    print(table(results, reference))
    if args.out:
        Path(args.out).write_text(json.dumps(
            {k: [r.as_dict() for r in v] for k, v in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
