#!/bin/sh
# The same A/B at 0.57 req/s, above 1P+1D's capacity, where the prefill queue is long: does
# reading prompts as they are computed (the decode replica's looks, its blocks taken early)
# cost the split anything there? on / off / off / on, at the commit named in README.md, from
# a worktree. Run from the repository root.
set -e
preset=docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
for s in true false false true; do
  python -m meshserve.bench.disagg --rates 0.57 --layouts 1P+1D --num-requests 80 \
    --ttft-ms 6000 --tpot-ms 20 --prefill-step-tokens 512 --connector nixl --stream-kv $s \
    --cluster $preset
done
