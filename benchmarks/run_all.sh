#!/usr/bin/env bash
# Every benchmark quoted in README.md, in sequence (one Ray cluster at a time: the
# machine's cores are the budget). About 30 minutes on 2 cores. Results land in
# benchmarks/results/; logs in benchmarks/results/logs/.
#   bash benchmarks/run_all.sh                 # all
#   bash benchmarks/run_all.sh e2e memory      # only these
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
B=.venv/bin/distflow-lab
R=benchmarks/results
ONLY="$*"
mkdir -p $R/logs
run() { local name=$1; shift; [[ -z "$ONLY" || " $ONLY " == *" $name "* ]] || return 0; echo "== $name: distflow-lab $*"; "$B" "$@" 2>&1 | tee "$R/logs/$name.log" | grep -v -E "INFO|it/s\]" || true; }
run dataplane bench dataplane --workers 2,4,8 --context 1024,4096,8192 --batch 64 --repeats 7 --json $R/dataplane.json
run dataplane_2nodes bench dataplane --workers 8 --context 8192 --nodes 2 --repeats 7 --no-control --json $R/dataplane_2nodes.json
run balance bench balance --json $R/balance.json
run serialization bench serialization --json $R/serialization.json
run e2e bench e2e --context 32,1024 --steps 6 --json $R/e2e.json
run ablation ablate --batches 64,256 --repeats 8 --out $R/ablation
run memory bench memory --steps 200 --json $R/memory.json --html $R/memory.html
