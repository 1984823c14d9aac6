#!/bin/bash
# Does 1P+1D's token tail come from the decode replica sharing its core? 1P+1D at 0.36
# req/s, 72 requests, as the OS places the processes, then with the front's process (the
# prefill replica's thread among them) bound to core 0 and the decode replica's to core 1
# (taskset on every thread, once the replica has started); twice each, in turns.
# Usage: probe.sh DIR, where DIR/meshserve is a worktree of the commit to run.
cd "$(dirname "$0")/../../../.."
code=$1
args=(--rates 0.36 --layouts 1P+1D --num-requests 72 --prefill-step-tokens 512
      --ttft-ms 6000 --tpot-ms 20 --cluster docs/benchmarks/records/cpu-2026-12-05-sim/disagg_preset.yaml)
git -C "$code/meshserve" log --oneline -1
for turn in 1 2; do
  for mode in free bound; do
    date -u +"%H:%M:%S $mode"
    PYTHONPATH=$code .venv/bin/python -m meshserve.bench.disagg "${args[@]}" 2>/dev/null > /tmp/probe.out &
    front=$!
    if [ $mode = bound ]; then
      until pid=$(pgrep -f "meshserve.engine.replica" | head -1) && [ -n "$pid" ]; do sleep 0.2; done
      sleep 1
      taskset -a -p -c 0 $front > /dev/null
      taskset -a -p -c 1 $pid > /dev/null
      echo "front $front -> core 0, decode replica $pid -> core 1"
    fi
    wait $front
    grep '"rate"' /tmp/probe.out
  done
done
date -u +%H:%M:%S
