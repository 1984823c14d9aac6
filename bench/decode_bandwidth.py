"""Batch-1 decode against the memory: the bytes of weights one decode step reads, over its
time, beside the single-thread read bandwidth of a C loop (kernels/native: ms_read_bytes)
over a buffer far larger than the caches, both on one thread in one run.

    python -m meshserve.bench.decode_bandwidth [--model tiny-bf16] [--rounds 3]

A decode step reads every linear weight once (the C panels, in the model's weight dtype:
2 bytes a value for bf16) and the LM head; the KV it reads (a 256-token context) is
counted apart.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from meshserve.bench import checkpoints, workloads
from meshserve.kernels import cpu_isa, native_cpu
from meshserve.kernels.host_memory import huge_page_empty

BUFFER_BYTES = 512 << 20
"""The read loop's buffer: far past any CPU's last-level cache, in huge pages (where the
kernel gives them) as the model's weights are."""


def read_bandwidth(rounds: int) -> float:
    """Bytes per second of the C read loop on one thread, best of `rounds` passes."""
    view = huge_page_empty((BUFFER_BYTES,), torch.uint8)  # as the weights are held
    assert view.data_ptr() % 64 == 0
    view.fill_(1)  # touch every page first
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        native_cpu.read_bytes(view)
        best = min(best, time.perf_counter() - t0)
    return BUFFER_BYTES / best


def step_bytes(model: Path, weight_bytes: int) -> tuple[int, int]:
    """(weight bytes, KV bytes at a 256-token context) one decode step reads."""
    c = json.loads((model / "config.json").read_text())
    h, i, layers, vocab = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                           c["vocab_size"])
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h
    weights = (layers * per_layer + vocab * h) * weight_bytes
    return weights, layers * 2 * kv * 256 * weight_bytes


def decode_seconds(model: Path, rounds: int, extra: list[str]) -> float:
    """Seconds per token of one 256-token prompt's 128 decode steps, median of rounds."""
    from meshserve import LLM, SamplingParams

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    ids = workloads.latency(vocab)[0].prompt_token_ids
    llm = LLM(str(model), overrides=["parallel=single", "threads=1",
                                     "engine.enable_prefix_caching=false", *extra],
              progress=False)
    try:
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        many = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
        llm.generate([ids], one, use_tqdm=False)
        per_token = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            llm.generate([ids], one, use_tqdm=False)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate([ids], many, use_tqdm=False)
            per_token.append((time.perf_counter() - t0 - ttft) / 128)
        return sorted(per_token)[len(per_token) // 2]
    finally:
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-bf16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="meshserve config overrides (key=value)")
    args = p.parse_args()
    torch.set_num_threads(1)
    if native_cpu.library() is None:
        raise SystemExit("the C kernels did not build: no read loop to measure against")
    model = checkpoints.resolve(args.model)
    dtype = json.loads((model / "config.json").read_text()).get("dtype", "float32")
    bf16 = dtype == "bfloat16" and not any(o.startswith("model.dtype=float32")
                                           for o in args.overrides)
    weights, kv = step_bytes(model, 2 if bf16 else 4)
    loop = read_bandwidth(args.rounds)
    seconds = decode_seconds(model, args.rounds, args.overrides)
    loop2 = read_bandwidth(args.rounds)  # again after: the machine may have drifted
    loop = max(loop, loop2)
    print(f"cpu flags: {' '.join(cpu_isa.vector_flags())}; path {cpu_isa.selected()}")
    print(f"C read loop, one thread: {loop / 1e9:.1f} GB/s")
    print(f"{args.model}: {seconds * 1e3:.2f} ms per token, {weights / 1e6:.1f} MB of weights "
          f"(+{kv / 1e6:.1f} MB KV) per step -> {weights / seconds / 1e9:.1f} GB/s of weights, "
          f"{weights / seconds / loop:.0%} of the read loop ({(weights + kv) / seconds / loop:.0%}"
          " with the KV)")


if __name__ == "__main__":
    main()
