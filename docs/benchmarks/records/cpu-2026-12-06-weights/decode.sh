#!/bin/bash
# Steady decode with fp32 against bf16 packed weights (bf16 KV cache), in turns; then one
# prompt's prefill (see README.md).
cd "$(dirname "$0")/../../../.."
for sp in "1 1000" "3 2000"; do
  set -- $sp
  for w in auto bfloat16 bfloat16 auto; do
    echo "seqs=$1 prompt=$2 weights=$w"
    .venv/bin/python -m meshserve.bench.steady_decode --seqs "$1" --prompt-tokens "$2" \
      --seconds 5 parallel=single threads=1 engine.kv_cache_dtype=bfloat16 \
      model.cpu_weight_dtype=$w 2>&1 | tail -1
  done
done
.venv/bin/python docs/benchmarks/records/cpu-2026-12-06-weights/prefill.py
