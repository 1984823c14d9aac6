#!/bin/sh
# Streamed KV listed after each step (72f37d1) against after each layer (9ce1e08): the
# same 100 requests at two prefill step budgets, before / after at each, back to back,
# nothing else on the machine. BEFORE and AFTER are worktrees of the two commits.
set -e
preset=docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
run() {  # run <worktree parent> <prefill step tokens>
  PYTHONPATH=$1 python -m meshserve.bench.disagg --rates 0.36 --layouts 1P+1D \
    --num-requests 100 --ttft-ms 6000 --tpot-ms 20 --prefill-step-tokens $2 \
    --connector torch --stream-kv true --cluster $preset
}
run "$BEFORE" 512
run "$AFTER" 512
run "$BEFORE" 2048
run "$AFTER" 2048
