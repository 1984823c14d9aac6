"""Steady-state drafted steps on the GPU: always draft (max_batch_size=8), warmed."""
import json, os, statistics, sys, time
import torch
from meshserve.engine.llm import LLM
from meshserve.engine.sampling_params import SamplingParams
from meshserve.bench.speculative import heldout_prompts, prompts

out = os.environ["OUT"]
base = ["parallel=single", "threads=1", "device=cuda", "model.dtype=bfloat16",
        "engine.num_gpu_blocks=2048", "engine.max_num_seqs=8"]
sp = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
def tps(llm, texts):
    torch.cuda.synchronize(); t = time.perf_counter(); n = 0
    for x in texts:
        n += sum(len(o.token_ids) for o in llm.generate([x], sp))
    torch.cuda.synchronize(); return n / (time.perf_counter() - t)
for method, texts in (("draft", heldout_prompts()[:6]), ("ngram", prompts()[:6])):
    plain = LLM("meshcoder", overrides=base, progress=False)
    spec = LLM("meshcoder", overrides=[*base, f"speculative={method}", "speculative.max_batch_size=8",
               f"engine.step_log='{out}/{method}_always.jsonl'"], progress=False)
    for llm in (plain, spec):
        tps(llm, texts); tps(llm, texts)  # warm every shape
    r = {"method": method}
    for rnd in range(2):
        for name, llm in (("none", plain), (method, spec)) if rnd == 0 else ((method, spec), ("none", plain)):
            r.setdefault(name, []).append(round(tps(llm, texts), 1))
    s = spec.engine.stats.spec
    r["acceptance"] = round(s.num_accepted_tokens / max(1, s.num_draft_tokens), 3)
    r["tokens_per_verify"] = round((s.num_accepted_tokens + s.num_drafts) / max(1, s.num_drafts), 2)
    print(json.dumps(r), flush=True)
    if method == "draft":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            spec.generate([texts[0]], SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
        prof.export_chrome_trace(f"{out}/draft_trace.json")
    plain.shutdown(); spec.shutdown()
