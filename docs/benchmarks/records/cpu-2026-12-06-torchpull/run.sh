#!/bin/sh
# The torch connector before (pushing, 8f153aa) and after (pulling, e3eb279), off and on:
# the same 100 requests, after-on / before / after-off / after-on, back to back, nothing
# else on the machine. BEFORE and AFTER are worktrees of the two commits.
set -e
preset=docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
run() {  # run <worktree parent> <stream_kv>
  PYTHONPATH=$1 python -m meshserve.bench.disagg --rates 0.36 --layouts 1P+1D \
    --num-requests 100 --ttft-ms 6000 --tpot-ms 20 --prefill-step-tokens 512 \
    --connector torch --stream-kv $2 --cluster $preset
}
run "$AFTER" true
run "$BEFORE" false
run "$AFTER" false
run "$AFTER" true
