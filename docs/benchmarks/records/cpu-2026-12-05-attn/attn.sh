#!/bin/sh
# Decode steps at batch 1, 2 and 3 with 1500-token contexts: this checkout against BASE,
# in one run, the side that goes first alternating; tiny model, one thread.
# Usage: attn.sh BASE_PARENT (a directory holding the base commit's meshserve/ checkout)
set -e
base=$1
for round in 1 2 3; do
  for seqs in 1 2 3; do
    for side in $( [ $((round % 2)) = 1 ] && echo "base new" || echo "new base" ); do
      if [ "$side" = base ]; then pp=$base; else pp=; fi
      printf '%s round=%s seqs=%s ' "$side" "$round" "$seqs"
      PYTHONPATH=$pp python -m meshserve.bench.steady_decode --seqs "$seqs" \
        --prompt-tokens 1500 --seconds 4 parallel=single threads=1 | tail -1
    done
  done
done
