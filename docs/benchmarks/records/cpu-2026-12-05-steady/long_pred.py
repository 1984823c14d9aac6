"""Simulated requests within TTFT 6 s and TPOT 20 ms of 72 and of 200 rag requests at the
rates the longer-trial check runs (steps scaled by the capacity searches' profile scales)."""

from meshserve.bench import checkpoints, workloads
from meshserve.bench.disagg import Simulated
from meshserve.bench.layout_check import load_cluster
from meshserve.models.arch import ModelArch

arch = ModelArch.from_dir(checkpoints.resolve("tiny"))
cluster = load_cluster("docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml")
for n in (72, 200):
    for name, rate, scale in (("1P+1D", 0.62, 1.093), ("dp=2", 0.36, 1.025)):
        reqs = workloads.resolve("rag", arch.vocab_size, rate=rate, num_requests=n)
        sims = Simulated(arch, reqs, 6000, 20, cluster, 512)
        s = sims.run(name, reqs, scale)
        print(n, name, rate, "simulated within SLOs", s.num_good, "of", n, flush=True)
