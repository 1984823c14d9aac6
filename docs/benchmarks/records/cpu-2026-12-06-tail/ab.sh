#!/bin/sh
# The commit before (b6a2828) and this change (28b30e3), each from a worktree through
# PYTHONPATH, in turns: base, new, new, base. Run from the repository root.
set -e
for side in base new new base; do
  if [ "$side" = base ]; then pp=/work/base; else pp=/work/new; fi
  printf '%s ' "$side"
  PYTHONPATH=$pp python docs/benchmarks/records/cpu-2026-12-06-tail/handoff_probe.py 0.36 60
done
