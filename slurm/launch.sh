#!/usr/bin/env bash
# Run one meshserve verb over the ranks of a Slurm allocation; the sbatch templates call it.
#
#   launch.sh [VERB] [HYDRA OVERRIDES...]      VERB: serve (default), generate, bench, plan
#
# MESHSERVE_LAUNCH=srun (default): one task per rank (per GPU), each reads its rank from
#   SLURM_PROCID / SLURM_LOCALID / SLURM_NODEID; the rendezvous is the first node.
# MESHSERVE_LAUNCH=torchrun: one torchrun per node (srun --ntasks-per-node=1), which starts
#   the node's ranks; c10d rendezvous on the first node.
# MESHSERVE_HOME: the meshserve checkout (default: the directory sbatch was run from);
# MESHSERVE_PYTHON: its interpreter (default: $MESHSERVE_HOME/.venv/bin/python);
# MESHSERVE_LOG_DIR: per-rank logs (default: $MESHSERVE_HOME/logs/<job name>-<job id>).
# The exit code is the job step's: non-zero when any rank failed.
set -euo pipefail
home=${MESHSERVE_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
python=${MESHSERVE_PYTHON:-$home/.venv/bin/python}
[ -x "$python" ] || { echo "meshserve: MESHSERVE_PYTHON=$python is not an interpreter: allowed" \
  "is the python of a meshserve install (./install.sh makes .venv/bin/python)" >&2; exit 2; }
verb=serve
case "${1:-}" in serve|generate|bench|plan|diagnose) verb=$1; shift ;; esac
logs=${MESHSERVE_LOG_DIR:-$home/logs/${SLURM_JOB_NAME:-meshserve}-${SLURM_JOB_ID:-0}}
mkdir -p "$logs"
nodes=${SLURM_JOB_NUM_NODES:-1}
ntasks=${SLURM_NTASKS:-1}
per_node=$(( ntasks / nodes ))
# Each rank's threads: its share of the node's CPUs (torch would otherwise take them all).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
echo "meshserve: job ${SLURM_JOB_ID:-?}: $verb on $nodes node(s) x $per_node rank(s)" \
  "(${MESHSERVE_LAUNCH:-srun}); logs in $logs" >&2

case ${MESHSERVE_LAUNCH:-srun} in
  srun)
    # --kill-on-bad-exit: a rank that fails takes the step down (meshserve's own failure
    # handling does the same within parallel.timeout_s; this is the backstop).
    set +e
    srun --kill-on-bad-exit=1 --output="$logs/rank%t.out" --error="$logs/rank%t.err" \
      "$python" -m meshserve.launch.cli "$verb" "$@"
    code=$?
    ;;
  torchrun)
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    # Node names need not resolve (NodeAddr may differ from NodeName): ask Slurm.
    addr=$(scontrol show node "$head" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
    port=$(( 20000 + (SLURM_JOB_ID % 4000) * 10 + 9 ))
    set +e
    srun --kill-on-bad-exit=1 --ntasks="$nodes" --ntasks-per-node=1 \
      --cpus-per-task=$(( per_node * ${SLURM_CPUS_PER_TASK:-1} )) \
      --output="$logs/node%n.out" --error="$logs/node%n.err" \
      "$python" -m torch.distributed.run --nnodes="$nodes" --nproc-per-node="$per_node" \
      --rdzv-backend=c10d --rdzv-endpoint="${addr:-$head}:$port" --rdzv-id="${SLURM_JOB_ID}" \
      -m meshserve.launch.cli "$verb" "$@"
    code=$?
    ;;
  *)
    echo "meshserve: MESHSERVE_LAUNCH=$MESHSERVE_LAUNCH is invalid: allowed is srun or torchrun" >&2
    exit 2
    ;;
esac
if [ "$code" -ne 0 ]; then
  echo "meshserve: job ${SLURM_JOB_ID:-?} failed (exit code $code); last lines of each rank:" >&2
  for f in "$logs"/*.err; do
    [ -s "$f" ] && { echo "--- $f" >&2; tail -n 5 "$f" >&2; }
  done
fi
exit "$code"
