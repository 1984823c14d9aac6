"""KV transfer time (the prefill replica holding the KV to the decode replica admitting
the request) by prefill replica, 2P+1D over NIXL on this machine's two cores: replica 0
runs in the front, replica 1 is remote. Run with the meshserve under test on PYTHONPATH;
prints one JSON line."""

import json
import statistics
import sys

import torch

from meshserve.bench import checkpoints, workloads
from meshserve.bench.harness import MeshserveRunner
from meshserve.engine.disagg import DisaggEngine
from meshserve.engine.runtime_config import load_runtime_config
from meshserve.models.arch import ModelArch

RATE, NUM = float(sys.argv[1]), int(sys.argv[2])
by_source: dict[int, list[float]] = {0: [], 1: []}
original = DisaggEngine._on_message


def on_message(self: DisaggEngine, index: int, msg: tuple) -> list:
    hop = self._hops.get(msg[1]) if msg[0] == "imported" else None
    before = self.transfers.num_transfers
    out = original(self, index, msg)
    if hop is not None and self.transfers.num_transfers > before:
        by_source[hop.prefill].append(self.transfers.recent[-1])
    return out


DisaggEngine._on_message = on_message  # type: ignore[method-assign]
torch.set_num_threads(1)
path = checkpoints.resolve("tiny")
arch = ModelArch.from_dir(path)
config = load_runtime_config([
    f"model.path='{path}'", "model.name=tiny", "engine.block_size=16", "parallel=single",
    "threads=1", "disagg=manual", "disagg.prefill.replicas=2", "disagg.connector=nixl",
    "engine.max_num_batched_tokens=512"])
runner = MeshserveRunner(config, name="2P+1D")
try:
    runner.run(workloads.resolve("rag", arch.vocab_size, seed=1, num_requests=4))  # warm-up
    for v in by_source.values():
        v.clear()
    result = runner.run(workloads.resolve("rag", arch.vocab_size, rate=RATE,
                                          num_requests=NUM))
finally:
    runner.llm.shutdown()
print(json.dumps({
    "rate": RATE, "num_requests": NUM, **{
        f"replica_{i}": {"transfers": len(v),
                         "p50_ms": round(statistics.median(v) * 1e3, 1) if v else None,
                         "mean_ms": round(statistics.mean(v) * 1e3, 1) if v else None,
                         "max_ms": round(max(v) * 1e3, 1) if v else None}
        for i, v in by_source.items()},
    "tpot_p50_ms": round(statistics.median(
        r.tpot for r in result.records if r.tpot is not None) * 1e3, 2)}))
