#!/usr/bin/env bash
# The benchmark peers (verl's own DataProto dispatch and Karmarkar-Karp, the bench
# extra) are part of the standard set-up now; this checks they are there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -c "from distflow_lab.experiments.bench import verl_peer; assert verl_peer.available(); print('verl peer ready')"
