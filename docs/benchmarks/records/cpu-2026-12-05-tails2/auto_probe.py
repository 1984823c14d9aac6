"""One replica, max_num_batched_tokens=auto, TPOT target 20 ms: what its steps carrying
decodes cost. Ten prompts of 1,000-2,000 tokens, one every 2.8 s; the step log read back."""

import json
import os
import random
import statistics
import time

from meshserve.bench import checkpoints
from meshserve.engine.llm import LLM
from meshserve.engine.sampling_params import SamplingParams

LOG = "/tmp/auto_steps.jsonl"

if os.path.exists(LOG):
    os.remove(LOG)
llm = LLM(str(checkpoints.resolve("tiny")),
          ["parallel=single", "threads=2", "engine.max_num_batched_tokens=auto",
           "scenario.tpot_slo_ms=20", "engine.block_size=16", f"engine.step_log={LOG}"],
          progress=False)
engine = llm.engine
random.seed(0)
pending = [([random.randrange(100, 30000) for _ in range(random.randint(1000, 2000))],
            random.randint(64, 256)) for _ in range(10)]
due = time.monotonic()
while pending or engine.has_unfinished():
    if pending and time.monotonic() >= due:
        ids, n = pending.pop(0)
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        due += 2.8
    if engine.has_unfinished():
        engine.step()
    else:
        time.sleep(0.01)
llm.shutdown()
steps = [json.loads(line) for line in open(LOG)][1:]
mixed = [s for s in steps if s["num_decode_seqs"] and s["num_prefill_tokens"]]
alone = [s for s in steps if s["num_decode_seqs"] and not s["num_prefill_tokens"]]
for name, group in (("decodes and a prompt chunk", mixed), ("decodes only", alone)):
    ms = [s["wall_s"] * 1e3 for s in group]
    tokens = [s["num_prefill_tokens"] for s in group]
    print(f"{name}: {len(group)} steps, ms median {statistics.median(ms):.1f} "
          f"(min {min(ms):.1f}, max {max(ms):.1f}), prompt tokens median "
          f"{statistics.median(tokens) if group else 0} (max {max(tokens, default=0)})")
print(f"{len(steps)} steps in all")
