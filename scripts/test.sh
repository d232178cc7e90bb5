#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite on a local, loopback-only Ray cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # Ray binds 127.0.0.1 only
export RAY_AUTH_MODE=disabled                # local test clusters only; attached clusters keep auth
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --durations=60 tests "$@"
