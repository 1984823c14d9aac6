#!/bin/sh
# 1P+1D with the prompt's KV read as it is computed (disagg.stream_kv=true) against all of
# it after the first token (false): the same 100 requests, off / on / on / off, back to
# back, nothing else on the machine. Run from the repository root at the commit named in
# README.md.
set -e
preset=docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
for s in false true true false; do
  python -m meshserve.bench.disagg --rates 0.36 --layouts 1P+1D --num-requests 100 \
    --ttft-ms 6000 --tpot-ms 20 --prefill-step-tokens 512 --connector nixl --stream-kv $s \
    --cluster $preset
done
