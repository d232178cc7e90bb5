#!/usr/bin/env bash
# Set up everything on a fresh machine: a venv in the repo with the pinned CPU
# torch installed FIRST (so nothing later pulls a multi-GB CUDA build), then
# distflow_lab and its dev tools at the versions in requirements/constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import distflow_lab, torch, ray" 2>/dev/null || [ "${DISTFLOW_REINSTALL:-0}" = 1 ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]" -c requirements/constraints.txt
fi
.venv/bin/python -c "import torch, ray, transformers; print(f'torch {torch.__version__}, ray {ray.__version__}, transformers {transformers.__version__}')"
