"""The `tiny` model on one thread serving N prompts of CTX tokens, 96 greedy tokens each,
writing step records for `meshserve diagnose`.

    python decode_probe.py N CTX STEPS.jsonl CLUSTER_PRESET
"""

from __future__ import annotations

import sys

import torch

from meshserve import LLM, SamplingParams
from meshserve.bench import checkpoints


def main() -> None:
    torch.set_num_threads(1)
    n, ctx, steps, cluster = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    llm = LLM(str(checkpoints.resolve("tiny")), progress=False, overrides=[
        "parallel=single", "threads=1", "engine.block_size=16",
        f"engine.step_log={steps}", f"cluster={cluster}"])
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (ctx,), generator=gen).tolist() for _ in range(n)]
    llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True))
    llm.shutdown()


if __name__ == "__main__":
    main()
