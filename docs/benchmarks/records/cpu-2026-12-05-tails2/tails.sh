#!/bin/bash
# TPOT p99 of 1P+1D, tp=2, dp=2 and 1x-auto at 0.36 req/s over the same 200 requests (README.md).
set -euo pipefail
cd "$(dirname "$0")"
root=../../../..
git -C "$root" log --oneline -1
date -u +%H:%M:%S
"$root/.venv/bin/python" -m meshserve.bench.disagg --rates 0.36 --layouts 1P+1D tp=2 dp=2 1x-auto \
    --num-requests 200 --ttft-ms 6000 --tpot-ms 20 \
    --cluster ../cpu-2026-12-05-sim/disagg_preset.yaml
date -u +%H:%M:%S
