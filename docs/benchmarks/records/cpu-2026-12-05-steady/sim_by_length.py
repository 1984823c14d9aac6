import random
from meshserve.bench import checkpoints, workloads
from meshserve.bench.layout_check import load_cluster
from meshserve.bench.disagg import Simulated
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.layout_sim import max_rate, ATTAINMENT
arch = ModelArch.from_dir(checkpoints.resolve("tiny"))
cluster = load_cluster("docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml")
tpot = 20
for n in (24, 48, 72, 96, 144, 240):
    base = workloads.resolve("rag", arch.vocab_size, rate=1.0, num_requests=min(n, 48))
    if n > 48:
        base = [r for s in range(n // 48 + 1) for r in workloads.resolve("rag", arch.vocab_size, seed=s, num_requests=48)][:n]
    sims = Simulated(arch, base, 6000, tpot, cluster, 512)
    row = []
    for name in ("1P+1D", "dp=2", "tp=2"):
        def served(rate):
            reqs = workloads.poisson(base, rate)
            s = sims.run(name, reqs, 1.07)
            return s is not None and s.num_good >= ATTAINMENT * n
        row.append(round(max_rate(served, 0.5, rel_tol=0.03), 3))
    print(n, row, round(row[0] / max(row[1:]), 2), flush=True)
