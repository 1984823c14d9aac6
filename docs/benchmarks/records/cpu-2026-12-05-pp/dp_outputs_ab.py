"""Data-parallel throughput with long prompts: dp=2 (replica 0 in this process, replica 1 a
child process), 24 prompts of 880 random token ids, 120 greedy tokens each, no prefix
cache. Prints the package's checkout (w: a worktree of the commit before the output deltas
first on PYTHONPATH; main: this checkout) and tok/s."""

import random
import time

import meshserve
from meshserve import LLM, SamplingParams

random.seed(0)
llm = LLM("meshcoder", overrides=["parallel.dp=2", "threads=1",
                                  "engine.enable_prefix_caching=false"], progress=False)
prompts = [[random.randrange(5, 4000) for _ in range(880)] for _ in range(24)]
sp = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:2], sp)
t = time.perf_counter()
outs = llm.generate(prompts, sp)
dt = time.perf_counter() - t
print(meshserve.__file__.split("/")[2], round(sum(len(o.token_ids) for o in outs) / dt, 1),
      "tok/s")
llm.shutdown()
