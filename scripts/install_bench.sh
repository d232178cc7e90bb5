#!/usr/bin/env bash
# Optional peer for the data-plane benchmark: verl's own DataProto dispatch.
# verl is installed WITHOUT its pinned dependencies (they would replace the CPU
# torch and pull GPU packages); the few modules its single-controller code
# imports come from the `bench` extra. Then `distflow-lab bench dataplane`
# adds a "verl" column.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install -q -e ".[bench]" -c requirements/constraints.txt
.venv/bin/python -m pip install -q --no-deps "verl==0.7.1"
.venv/bin/python -c "from distflow_lab.experiments.bench import verl_peer; assert verl_peer.available(); print('verl peer ready')"
