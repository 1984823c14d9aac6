"""Steady-state decode speed of a layout: N sequences decoding together, timed per token.

    python -m meshserve.bench.steady_decode --seqs 10 --seconds 5 parallel.pp=2

Adds `--seqs` requests of `--prompt-tokens` random tokens (greedy, no stop), runs until
each has its first token and a few more steps, then times `Engine.step` for `--seconds`.
Prints the milliseconds per token of every sequence (one decode step of the whole batch,
however many micro-batches it takes) and the generated tokens per second. The remaining
arguments are config overrides (`parallel.pp=2`, `parallel=single`, ...).
"""

from __future__ import annotations

import argparse
import random
import time

from meshserve.bench import checkpoints

WARM_STEPS = 6
"""Steps run after every sequence has its first token, before timing starts."""


def measure(model_dir: str, num_seqs: int, prompt_tokens: int, seconds: float,
            overrides: list[str]) -> tuple[float, float]:
    """(ms per token of every sequence, generated tokens per second)."""
    from meshserve import LLM, SamplingParams

    llm = LLM(model_dir, overrides=overrides, progress=False)
    try:
        engine = llm.engine
        rng = random.Random(0)
        vocab = engine.arch.vocab_size
        params = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        for _ in range(num_seqs):
            engine.add_request([rng.randrange(vocab) for _ in range(prompt_tokens)], params)
        started = 0
        while started < num_seqs:
            started += sum(1 for o in engine.step() if len(o.token_ids) == 1)
        for _ in range(WARM_STEPS):
            engine.step()
        t0 = time.perf_counter()
        tokens = 0
        while time.perf_counter() - t0 < seconds:
            tokens += len(engine.step())
        elapsed = time.perf_counter() - t0
    finally:
        llm.shutdown()
    return 1000 * elapsed / tokens * num_seqs, tokens / elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="a bench checkpoint name or directory")
    parser.add_argument("--seqs", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.pp=2")
    args = parser.parse_args(argv)
    if args.seqs < 1 or args.prompt_tokens < 1 or args.seconds <= 0:
        parser.error("--seqs and --prompt-tokens must be >= 1 and --seconds > 0")
    overrides = list(args.overrides)
    if not any(o.startswith("threads=") for o in overrides):
        overrides.append("threads=1")
    model_dir = str(checkpoints.resolve(args.model))
    ms, tok_s = measure(model_dir, args.seqs, args.prompt_tokens, args.seconds, overrides)
    print(f"{args.seqs} sequences, {' '.join(overrides)}: {ms:.1f} ms per token of every "
          f"sequence, {tok_s:.1f} tok/s")


if __name__ == "__main__":
    main()
