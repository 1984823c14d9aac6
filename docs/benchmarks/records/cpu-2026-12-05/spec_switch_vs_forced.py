"""Batch-1 draft speculation with the run-time switch and forced on every step, against
none: the ten held-out prompts one at a time, 128 tokens, three rounds alternating (the
first untimed); tok/s over the workload, then per prompt."""

import time

import torch

from meshserve.bench.speculative import heldout_prompts
from meshserve.engine.llm import LLM
from meshserve.engine.sampling_params import SamplingParams


def main() -> None:
    torch.set_num_threads(1)
    texts = heldout_prompts()
    sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    base = ["parallel=single", "threads=1", "device=cpu"]
    llms = {"none": LLM("meshcoder", overrides=base, progress=False),
            "switch": LLM("meshcoder", overrides=[*base, "speculative=draft"], progress=False),
            "forced": LLM("meshcoder", overrides=[*base, "speculative=draft",
                                                  "speculative.max_batch_size=1"],
                          progress=False)}
    seconds = {name: [0.0] * len(texts) for name in llms}
    for r in range(3):
        order = list(llms.items()) if r % 2 == 0 else list(llms.items())[::-1]
        for name, llm in order:
            for i, text in enumerate(texts):
                t = time.perf_counter()
                llm.generate([text], sp)
                if r:
                    seconds[name][i] += time.perf_counter() - t
    for name, per in seconds.items():
        print(name, round(128 * len(texts) * 2 / sum(per), 1), "tok/s",
              [round(128 * 2 / s) for s in per])
    for llm in llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
