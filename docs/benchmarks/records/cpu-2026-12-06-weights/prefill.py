"""One 2,000-token prompt's prefill on one thread (one 2,048-token step, one output token),
fp32 against bf16 packed weights in turns, best of three each."""
import time

import torch

from meshserve import LLM, SamplingParams
from meshserve.bench import checkpoints

torch.set_num_threads(1)
path = str(checkpoints.resolve("tiny"))
prompt = torch.randint(0, 32000, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
for weights in ("auto", "bfloat16", "bfloat16", "auto"):
    llm = LLM(path, overrides=["parallel=single", "threads=1", "engine.kv_cache_dtype=bfloat16",
                               f"model.cpu_weight_dtype={weights}",
                               "engine.enable_prefix_caching=false"], progress=False)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        llm.generate([prompt], one)
        best = min(best, time.perf_counter() - t)
    print(f"weights={weights}: 2000-token prefill {best * 1e3:.0f} ms")
    llm.shutdown()
