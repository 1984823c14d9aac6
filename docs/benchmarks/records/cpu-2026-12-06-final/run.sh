#!/bin/sh
# The TPOT-tail check at 0.36 req/s (every layout, the same 200 requests), then 1P+1D
# alone at 0.57 req/s (200 requests), back to back, nothing else on the machine, at
# 932aa3e from a worktree (PYTHONPATH=/work/new). Run from the repository root.
set -e
preset=docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
PYTHONPATH=/work/new python -m meshserve.bench.disagg --rates 0.36 --layouts 1P+1D tp=2 dp=2 \
  --num-requests 200 --ttft-ms 6000 --tpot-ms 20 --cluster $preset
PYTHONPATH=/work/new python -m meshserve.bench.disagg --rates 0.57 --layouts 1P+1D \
  --num-requests 200 --ttft-ms 6000 --tpot-ms 20 --cluster $preset
