#!/bin/sh
# The torch connector's hand-off through its shared-memory channel against gloo, with NIXL (not
# streamed) beside them: 1P+1D, 40 rag requests at 0.3 req/s each, in the order gloo,
# shm, nixl, shm, gloo, from a worktree of the commit (PYTHONPATH=/work/new), nothing
# else on the machine. Run from the repository root.
set -e
preset=docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
run() {
  PYTHONPATH=/work/new python -m meshserve.bench.disagg --rates 0.3 --layouts 1P+1D \
    --num-requests 40 --ttft-ms 6000 --tpot-ms 20 --cluster $preset "$@"
}
run --connector torch --torch-shm false
run --connector torch --torch-shm true
run --connector nixl --stream-kv false
run --connector torch --torch-shm true
run --connector torch --torch-shm false
