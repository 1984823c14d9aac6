#!/bin/bash
# Usage: ab.sh OLD_PARENT_DIR [LAYOUT ...]  (a worktree of the commit before at
# OLD_PARENT_DIR/meshserve): for each layout (default: 1P+1D 1P+1D dp=2) the commit
# before, then this one.
cd "$(dirname "$0")/../../../.."
old=$1
shift
layouts=("$@")
[ ${#layouts[@]} -eq 0 ] && layouts=(1P+1D 1P+1D dp=2)
run() {  # label pythonpath layout
  date -u
  echo "\$ [$1] python -m meshserve.bench.disagg --rates 0.36 --layouts $3 --num-requests 72 --prefill-step-tokens 512 --ttft-ms 6000 --tpot-ms 20 --cluster docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml"
  PYTHONPATH=$2 .venv/bin/python -m meshserve.bench.disagg --rates 0.36 --layouts "$3" \
    --num-requests 72 --prefill-step-tokens 512 --ttft-ms 6000 --tpot-ms 20 \
    --cluster docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml 2>/dev/null \
    | grep '"rate"'
}
echo "old: $(git -C "$old/meshserve" rev-parse --short HEAD)  new: $(git rev-parse --short HEAD)"
for layout in "${layouts[@]}"; do
  run old "$old" "$layout"
  run new "" "$layout"
done
date -u
