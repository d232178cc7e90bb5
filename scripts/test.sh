#!/usr/bin/env bash
# Set up (if needed) and run the tests on a local, loopback-only Ray cluster.
#   bash scripts/test.sh           the default tier: every subsystem on real parts (<= 8 min on 2 cores)
#   bash scripts/test.sh --full    everything (<= 30 min on 2 cores): what CI runs (.ci/run)
# Other arguments go to pytest. Per-test times land in .test-results/junit-<tier>.xml
# (python scripts/durations.py on it: where the time went). The suite enforces its own budget
# (tests/suite_budget.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0   # Ray binds 127.0.0.1 only
export RAY_AUTH_MODE=disabled                # local test clusters only; attached clusters keep auth
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
tier=default
for a in "$@"; do if [ "$a" = "--full" ]; then tier=full; fi; done
mkdir -p .test-results
exec .venv/bin/python -m pytest -q -p no:cacheprovider --junitxml=".test-results/junit-$tier.xml" tests "$@"
