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
# Reinstall when the declared dependencies changed since the last install (or on request).
stamp=$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -c1-16)
if [ "$(cat .venv/.distflow-installed 2>/dev/null)" != "$stamp" ] || [ "${DISTFLOW_REINSTALL:-0}" = 1 ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[dev]" -c requirements/constraints.txt
  echo "$stamp" > .venv/.distflow-installed
fi
.venv/bin/python -c "import torch, ray, transformers; print(f'torch {torch.__version__}, ray {ray.__version__}, transformers {transformers.__version__}')"
