"""1P+1D on bench.disagg's rag workload: RATE req/s, N requests (threads=1 per replica,
2048-token steps, KV cache dtype KV), the decode replica's step log kept. Prints TPOT
p50/p99, the five slowest requests by TPOT (tokens, hand-off, TPOT without it), and the
decode replica's decode-only steps by batch size: count, mean context per sequence, wall
p50/p90/max. Usage: python tail_probe.py RATE N KV"""
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from meshserve.bench import checkpoints, workloads
from meshserve.bench.disagg import BLOCK_SIZE, LAYOUTS
from meshserve.bench.harness import MeshserveRunner
from meshserve.bench.metrics import percentile
from meshserve.engine.runtime_config import load_runtime_config
from meshserve.models.arch import ModelArch

rate, n, kv = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.set_num_threads(1)
path = checkpoints.resolve("tiny")
arch = ModelArch.from_dir(path)
log = Path(tempfile.mkdtemp()) / "steps.jsonl"
config = load_runtime_config([f"model.path='{path}'", "model.name=tiny",
                              f"engine.block_size={BLOCK_SIZE}", "scenario.tpot_slo_ms=20",
                              "scenario.ttft_slo_ms=6000", *LAYOUTS["1P+1D"],
                              "engine.max_num_batched_tokens=2048",
                              f"engine.kv_cache_dtype={kv}", f"engine.step_log={log}"])
runner = MeshserveRunner(config, name="1P+1D")
try:
    res = runner.run(workloads.resolve("rag", arch.vocab_size, rate=rate, num_requests=n))
finally:
    runner.llm.shutdown()
recs = [r for r in res.records if r.tpot is not None and r.itl]
ms = lambda xs, q: 1e3 * percentile(xs, q)  # noqa: E731
print(f"kv {kv}: TPOT p50 {ms([r.tpot for r in recs], 50):.2f} "
      f"p99 {ms([r.tpot for r in recs], 99):.2f}")
for r in sorted(recs, key=lambda r: -r.tpot)[:5]:
    rest = (r.finish - r.first_token - r.itl[0]) / max(r.num_generated_tokens - 2, 1)
    print(f"  TPOT {1e3 * r.tpot:.2f} ms: {r.num_generated_tokens} tokens, prompt "
          f"{r.num_prompt_tokens}, hand-off {1e3 * r.itl[0]:.1f} ms, without it "
          f"{1e3 * rest:.2f}, max ITL {1e3 * max(r.itl[1:]):.1f}")
steps = [json.loads(line) for line in log.with_suffix(".replica1.jsonl").read_text().splitlines()]
steps = [s for s in steps if "wall_s" in s and not s.get("num_prefill_tokens")]
by = defaultdict(list)
for s in steps:
    by[s["num_decode_seqs"]].append(s)
for b in sorted(by):
    walls = [s["wall_s"] for s in by[b]]
    ctx = statistics.fmean(s["num_decode_context_tokens"] / b for s in by[b])
    print(f"  decode steps of {b}: {len(walls)}, context {ctx:.0f} a sequence, wall p50 "
          f"{ms(walls, 50):.1f} p90 {ms(walls, 90):.1f} max {1e3 * max(walls):.1f} ms")
