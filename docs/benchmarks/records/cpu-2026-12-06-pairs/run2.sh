#!/bin/sh
# From the repository root, the venv's python on PATH.
for w in gloo gloo_pairs gloo_pairs gloo; do
  python -m meshserve.bench.disagg --rates 0.36 --layouts 1P+1D --num-requests 60 \
    --ttft-ms 6000 --tpot-ms 20 --connector torch --torch-shm false --torch-wire $w \
    --cluster docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
done
