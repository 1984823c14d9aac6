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
echo "meshserve installed in $(pwd)/.venv (torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'))"
