"""1P+1D on bench.disagg's rag workload: RATE req/s, N requests (threads=1 per replica,
2048-token steps). Prints TTFT, TPOT and inter-token latency p50/p99 and, per request, the
hand-off interval (the prefill replica's first token to the decode replica's second) and
TPOT without it. Usage: python handoff_probe.py RATE N"""
import statistics
import sys

import torch

from meshserve.bench import checkpoints, workloads
from meshserve.bench.disagg import BLOCK_SIZE, LAYOUTS
from meshserve.bench.harness import MeshserveRunner
from meshserve.bench.metrics import percentile
from meshserve.engine.runtime_config import load_runtime_config
from meshserve.models.arch import ModelArch

rate, n = float(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
path = checkpoints.resolve("tiny")
arch = ModelArch.from_dir(path)
config = load_runtime_config([f"model.path='{path}'", "model.name=tiny",
                              f"engine.block_size={BLOCK_SIZE}", "scenario.tpot_slo_ms=20",
                              "scenario.ttft_slo_ms=6000", *LAYOUTS["1P+1D"],
                              "engine.max_num_batched_tokens=2048"])
runner = MeshserveRunner(config, name="1P+1D")
try:
    res = runner.run(workloads.resolve("rag", arch.vocab_size, rate=rate, num_requests=n))
finally:
    runner.llm.shutdown()
recs = [r for r in res.records if r.tpot is not None and r.itl]
ms = lambda xs, q: 1e3 * percentile(xs, q)  # noqa: E731
hand = [r.itl[0] for r in recs]
rest = [(r.finish - r.first_token - r.itl[0]) / max(r.num_generated_tokens - 2, 1)
        for r in recs]
itl = [x for r in recs for x in r.itl]
print(f"TTFT p50 {ms([r.ttft for r in recs], 50):.0f} p99 {ms([r.ttft for r in recs], 99):.0f}"
      f" | TPOT p50 {ms([r.tpot for r in recs], 50):.2f} p99 {ms([r.tpot for r in recs], 99):.2f}"
      f" | ITL p50 {ms(itl, 50):.1f} p99 {ms(itl, 99):.1f}"
      f" | hand-off p50 {ms(hand, 50):.1f} p99 {ms(hand, 99):.1f}"
      f" | TPOT without it p50 {ms(rest, 50):.2f} p99 {ms(rest, 99):.2f}"
      f" | mean decode-side ITL {1e3 * statistics.fmean(x for r in recs for x in r.itl[1:]):.2f}")
