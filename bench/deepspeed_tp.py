"""DeepSpeed-Inference tensor parallelism on the tensor-parallel cases (the TP peer).

Run under torchrun, one rank per TP rank:

    torchrun --standalone --nproc-per-node 2 -m meshserve.bench.deepspeed_tp \
        --model DIR --out result.json [--threads 1] [--repeats 2]

Each rank loads the transformers model, `deepspeed.init_inference` shards it (automatic
tensor parallelism, no kernel injection: the CPU path) and sums through DeepSpeed's own
shared-memory all-reduce. Every case runs `generate` greedily with EOS ignored; a streamer
stamps the prompt and each new token. Rank 0 writes the `CaseResult`s as JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from pathlib import Path

import torch

from meshserve.bench.peers import PAD_TOKEN_ID, TokenStamps, load_hf_model
from meshserve.bench.tp_cases import (
    CASE_NAMES,
    Case,
    CaseResult,
    make_cases,
    median_step_seconds,
    select_cases,
    warmup_case,
)


def run_case(model: torch.nn.Module, case: Case) -> tuple[float, list[list[int]]]:
    """One generate over the case's prompts (all the same length): its metric and the ids."""
    ids = torch.tensor(case.prompts, dtype=torch.long)
    stamps = TokenStamps()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=case.max_new_tokens,
                             min_new_tokens=case.max_new_tokens, streamer=stamps,
                             pad_token_id=PAD_TOKEN_ID)
    new = out[:, ids.shape[1]:].tolist()
    token_times = stamps.times[1:]  # the first put is the prompt
    if case.metric == "ttft_s":
        return token_times[0] - t0, new
    return median_step_seconds(token_times), new


def run_cases(model: torch.nn.Module, cases: list[Case], repeats: int) -> list[CaseResult]:
    """A warm-up (first-call allocations, DeepSpeed's all-reduce build), then every case
    `repeats` times; the last repeat's token ids."""
    run_case(model, warmup_case(model.config.vocab_size))
    results = []
    for case in cases:
        result = CaseResult(case.name, case.metric)
        for _ in range(repeats):
            seconds, result.token_ids = run_case(model, case)
            result.seconds.append(seconds)
        results.append(result)
    return results


def main(argv: list[str] | None = None) -> None:
    """Shard the model with DeepSpeed, run the cases, write rank 0's results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--out", required=True, help="JSON result file (rank 0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--cases", default=",".join(CASE_NAMES),
                        help="comma-separated cases to run")
    args = parser.parse_args(argv)

    # DeepSpeed's CPU all-reduce reads the ranks per host from LOCAL_SIZE; torchrun sets
    # LOCAL_WORLD_SIZE. Without it the shared-memory op crashes (docs/benchmarks/README.md, peers).
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    world = torch.distributed.get_world_size()
    model = load_hf_model(args.model, torch.float32)
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": world},
                                      dtype=torch.float32, replace_with_kernel_inject=False)
    model = engine.module
    vocab = model.config.vocab_size
    cases = select_cases(make_cases(vocab, args.decode_tokens), args.cases)
    results = [r.as_dict() for r in run_cases(model, cases, args.repeats)]
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"engine": f"deepspeed-tp{world}",
                                              "threads": args.threads, "cases": results}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    remove_shm_buffers(os.environ.get("MASTER_PORT", ""))


def remove_shm_buffers(port: str) -> list[str]:
    """Delete this run's DeepSpeed all-reduce buffers (`/dev/shm/deepspeed_allreduce_buffer_
    <n>_<host>_<port>_<rank>`, about 70 MB each): DeepSpeed leaves them behind. Each rank
    deletes only its own run's, after every rank is past the last collective."""
    removed = []
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{glob.escape(port)}_*"):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:  # the other rank got there first
            pass
    return removed


if __name__ == "__main__":
    main()
