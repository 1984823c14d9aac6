"""Steady-state drafted steps on the GPU: every decode step drafts (max_batch_size=8),
both engines warmed twice over the workload, batch 1, two alternating rounds.

    OUT=DIR python3 always_draft.py
"""

import json
import os
import time

import torch

from meshserve.bench.speculative import heldout_prompts, prompts
from meshserve.engine.llm import LLM
from meshserve.engine.sampling_params import SamplingParams

OUT = os.environ["OUT"]
BASE = ["parallel=single", "threads=1", "device=cuda", "model.dtype=bfloat16",
        "engine.num_gpu_blocks=2048", "engine.max_num_seqs=8"]
SP = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)


def tok_s(llm: LLM, texts: list[str]) -> float:
    torch.cuda.synchronize()
    t, n = time.perf_counter(), 0
    for x in texts:
        n += sum(len(o.token_ids) for o in llm.generate([x], SP))
    torch.cuda.synchronize()
    return n / (time.perf_counter() - t)


def main() -> None:
    for method, texts in (("draft", heldout_prompts()[:6]), ("ngram", prompts()[:6])):
        plain = LLM("meshcoder", overrides=BASE, progress=False)
        spec = LLM("meshcoder", overrides=[*BASE, f"speculative={method}",
                                           "speculative.max_batch_size=8",
                                           f"engine.step_log='{OUT}/{method}_always.jsonl'"],
                   progress=False)
        for llm in (plain, spec):  # warm every shape
            tok_s(llm, texts)
            tok_s(llm, texts)
        row: dict[str, object] = {"method": method}
        for rnd in range(2):
            sides = [("none", plain), (method, spec)]
            for name, llm in sides if rnd == 0 else sides[::-1]:
                row.setdefault(name, []).append(round(tok_s(llm, texts), 1))  # type: ignore[union-attr]
        s = spec.engine.stats.spec
        row["acceptance"] = round(s.num_accepted_tokens / max(1, s.num_draft_tokens), 3)
        row["tokens_per_verify"] = round((s.num_accepted_tokens + s.num_drafts)
                                         / max(1, s.num_drafts), 2)
        print(json.dumps(row), flush=True)
        if method == "draft":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                spec.generate([texts[0]], SamplingParams(max_tokens=48, temperature=0.0,
                                                         ignore_eos=True))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                            max_name_column_width=60))
        plain.shutdown()
        spec.shutdown()


if __name__ == "__main__":
    main()
