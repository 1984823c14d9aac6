#!/bin/sh
# The TPOT tail of 1P+1D against tp=2 over bf16 weights and a bf16 KV cache (README.md).
# Run from the repository root, nothing else on the machine.
set -e
python -m meshserve.bench.disagg --rates 0.36 --layouts 1P+1D tp=2 --num-requests 100 \
  --ttft-ms 6000 --tpot-ms 20 --kv-cache-dtype bfloat16 --cpu-weight-dtype bfloat16 \
  --cluster docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
