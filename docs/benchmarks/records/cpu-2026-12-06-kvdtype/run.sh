#!/bin/sh
# Every layout over a bf16 KV cache: the TPOT-tail check at 0.36 req/s (the same 200
# requests), then 1P+1D alone at 0.57 req/s, back to back, nothing else on the machine, at
# 281b5b4 from a worktree (PYTHONPATH=/work/new). Run from the repository root.
set -e
preset=docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
PYTHONPATH=/work/new python -m meshserve.bench.disagg --rates 0.36 --layouts 1P+1D tp=2 dp=2 \
  --num-requests 200 --ttft-ms 6000 --tpot-ms 20 --kv-cache-dtype bfloat16 --cluster $preset
PYTHONPATH=/work/new python -m meshserve.bench.disagg --rates 0.57 --layouts 1P+1D \
  --num-requests 200 --ttft-ms 6000 --tpot-ms 20 --kv-cache-dtype bfloat16 --cluster $preset
