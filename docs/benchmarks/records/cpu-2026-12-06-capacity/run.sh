#!/bin/sh
# The capacity search over 72-request trials at 46f7406 from a worktree
# (PYTHONPATH=/work/new), nothing else on the machine. Run from the repository root.
set -e
PYTHONPATH=/work/new python -m meshserve.bench.disagg --capacity --num-requests 72 \
  --ttft-ms 6000 --tpot-ms 20 --cluster docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml
