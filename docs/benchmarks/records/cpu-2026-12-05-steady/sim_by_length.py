"""Simulated capacity of 1P+1D, dp=2 and tp=2 on the rag workload as a trial grows from 24
to 240 requests (TTFT 6 s, TPOT 20 ms, steps x1.07: the earlier runs' profile scale)."""

from meshserve.bench import checkpoints, workloads
from meshserve.bench.disagg import Simulated
from meshserve.bench.layout_check import load_cluster
from meshserve.models.arch import ModelArch
from meshserve.parallel.planner.goodput import ATTAINMENT
from meshserve.parallel.planner.rate_search import max_rate

arch = ModelArch.from_dir(checkpoints.resolve("tiny"))
cluster = load_cluster("docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml")


def capacity(sims: Simulated, name: str, base: list, n: int) -> float:
    def served(rate: float) -> bool:
        s = sims.run(name, workloads.poisson(base, rate), 1.07)
        return s is not None and s.num_good >= ATTAINMENT * n
    return round(max_rate(served, 0.5, rel_tol=0.03), 3)


for n in (24, 48, 72, 96, 144, 240):
    base = workloads.resolve("rag", arch.vocab_size, rate=1.0, num_requests=min(n, 48))
    if n > 48:  # six seeds' 48 requests each (drawn before the workload drew more)
        base = [r for s in range(n // 48 + 1)
                for r in workloads.resolve("rag", arch.vocab_size, seed=s, num_requests=48)][:n]
    sims = Simulated(arch, base, 6000, 20, cluster, 512)
    row = [capacity(sims, name, base, n) for name in ("1P+1D", "dp=2", "tp=2")]
    print(n, row, round(row[0] / max(row[1:]), 2), flush=True)
