#!/bin/bash
# The x1.5 bracket: 1P+1D at 0.555 req/s, then tp=2 at 0.37, 200 requests each (README.md).
set -euo pipefail
cd "$(dirname "$0")"
root=../../../..
git -C "$root" log --oneline -1
for pair in "0.555 1P+1D" "0.37 tp=2"; do
    set -- $pair
    date -u +%H:%M:%S
    "$root/.venv/bin/python" -m meshserve.bench.disagg --rates "$1" --layouts "$2" \
        --num-requests 200 --ttft-ms 6000 --tpot-ms 20 \
        --cluster ../cpu-2026-12-05-sim/disagg_preset.yaml
done
date -u +%H:%M:%S
