#!/bin/bash
# Steady decode, fp32 against bf16 KV cache, in turns (see README.md).
cd "$(dirname "$0")/../../../.."
for sp in "1 1000" "3 2000" "8 1500"; do
  set -- $sp
  for kv in auto bfloat16 bfloat16 auto; do
    echo "seqs=$1 prompt=$2 kv=$kv"
    .venv/bin/python -m meshserve.bench.steady_decode --seqs "$1" --prompt-tokens "$2" \
      --seconds 5 parallel=single threads=1 engine.kv_cache_dtype=$kv 2>&1 | tail -2
  done
done
