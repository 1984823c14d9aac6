"""Simulated requests within TTFT 6 s and TPOT 20 ms of 200 rag requests: dp=2 below
0.30 req/s and 1P+1D at 0.36 (steps scaled by the third check's profile scales)."""

from meshserve.bench import checkpoints, workloads
from meshserve.bench.disagg import Simulated
from meshserve.bench.layout_check import load_cluster
from meshserve.models.arch import ModelArch

arch = ModelArch.from_dir(checkpoints.resolve("tiny"))
cluster = load_cluster("docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml")
for name, rate, scale in (("dp=2", 0.22, 1.043), ("dp=2", 0.25, 1.043), ("dp=2", 0.27, 1.043), ("1P+1D", 0.36, 1.044)):
    reqs = workloads.resolve("rag", arch.vocab_size, rate=rate, num_requests=200)
    s = Simulated(arch, reqs, 6000, 20, cluster, 512).run(name, reqs, scale)
    print(name, rate, "simulated within SLOs", s.num_good, "of 200", flush=True)
