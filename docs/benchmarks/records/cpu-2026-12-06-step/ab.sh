#!/bin/sh
# 1P+1D with 512-token prefill steps against 2048-token ones (the engine's default), in
# turns, on the same 72 rag requests at 0.5 req/s. Run from the repository root.
set -e
for steps in 512 2048 512 2048; do
  echo "prefill-step-tokens=$steps"
  PYTHONPATH=/work/base python -m meshserve.bench.disagg --rates 0.5 --layouts 1P+1D --num-requests 72 \
    --ttft-ms 6000 --tpot-ms 20 --prefill-step-tokens "$steps" \
    --cluster docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml | grep '"rate"'
done
