#!/usr/bin/env bash
# Set up meshserve in ./.venv: torch first (CPU build on machines without a GPU, the
# ordinary CUDA build where there is one), then meshserve itself, editable.
#   ./install.sh          runtime only
#   ./install.sh --dev    plus the test and benchmark extras (pytest, transformers, ...)
set -euo pipefail
cd "$(dirname "$0")"
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" torch                       # CUDA build
  else
    "${pip[@]}" "torch==2.13.0"             # CPU build here; a bare `torch` pulls CUDA (GBs)
  fi
fi
"${pip[@]}" -e ".${extras}"
if [ -n "$extras" ]; then
  # The launch tests run a real local Slurm and mpirun: system packages, where apt works.
  need=()
  command -v slurmctld >/dev/null 2>&1 || need+=(slurm-wlm)
  command -v mpicc >/dev/null 2>&1 || need+=(openmpi-bin libopenmpi-dev)
  if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      export DEBIAN_FRONTEND=noninteractive
      apt-get install -y -q "${need[@]}" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${need[@]}" >/dev/null 2>&1; } \
        || echo "note: could not apt-get install ${need[*]}: the Slurm/MPI launch tests will skip"
    else
      echo "note: ${need[*]} missing (needs root and apt-get): the Slurm/MPI launch tests will skip"
    fi
  fi
  # mpi4py builds against the system MPI (mpicc), so it is not a pip extra.
  if command -v mpicc >/dev/null 2>&1 && ! .venv/bin/python -c "import mpi4py" 2>/dev/null; then
    "${pip[@]}" mpi4py || echo "note: mpi4py did not build: the mpirun tests will skip"
  fi
fi
echo "meshserve installed in $(pwd)/.venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
