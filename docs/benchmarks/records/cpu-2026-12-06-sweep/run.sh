#!/bin/sh
# The TPOT-tail check between the colocated layouts' capacity and the split's: every
# layout at 0.45 and at 0.54 req/s, the same 200 rag requests a rate, back to back,
# nothing else on the machine, at cdf668c from a worktree (PYTHONPATH=/work/new). Run
# from the repository root.
set -e
preset=docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
PYTHONPATH=/work/new python -m meshserve.bench.disagg --rates 0.45 0.54 \
  --layouts 1P+1D tp=2 dp=2 --num-requests 200 --ttft-ms 6000 --tpot-ms 20 --cluster $preset
