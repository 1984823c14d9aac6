#!/bin/sh
# Run from the repository root with the venv's python on PATH; BEFORE is a worktree's
# parent directory holding the commit before (ddd07e2) as meshserve/.
set -e
here=docs/benchmarks/records/cpu-2026-12-06-pairs
for c in 1 2; do
  for w in before gloo gloo_pairs gloo_pairs gloo before; do
    if [ "$w" = before ]; then
      PYTHONPATH=$BEFORE python $here/kv_wire.py --wire gloo --concurrent $c --rounds 30
    else
      python $here/kv_wire.py --wire $w --concurrent $c --rounds 30
    fi
  done
done
