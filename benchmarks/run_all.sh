#!/usr/bin/env bash
# Every benchmark quoted in README.md, in sequence (one Ray cluster at a time: the
# machine's cores are the budget). About 65 minutes on 2 cores (the async study alone ~20). Results land in
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
run() { local name=$1; shift; [[ -z "$ONLY" || " $ONLY " == *" $name "* ]] || return 0; echo "== $name: distflow-lab $*"; "$B" "$@" --overwrite 2>&1 | tee "$R/logs/$name.log" | grep -v -E "INFO|it/s\]" || true; }
run dataplane bench dataplane --workers 2,4,8 --context 1024,4096,8192 --batch 64 --repeats 7 --json $R/dataplane.json
run dataplane_2nodes bench dataplane --workers 8 --context 8192 --nodes 2 --repeats 7 --no-control --json $R/dataplane_2nodes.json
run balance bench balance --json $R/balance.json
run serialization bench serialization --json $R/serialization.json
run e2e bench e2e --context 32,1024 --steps 6 --json $R/e2e.json
run ablation ablate --batches 64,256 --repeats 8 --out $R/ablation
run memory bench memory --steps 200 --json $R/memory.json --html $R/memory.html
run memory_sweep bench memory --sweep-batch 16,64,256 --json $R/memory_sweep.json
run coordinator bench coordinator --json $R/coordinator.json
run async bench async --steps 12 --json $R/async.json
run microbatch bench microbatch --threads 1 --json $R/microbatch.json
run cli_latency bench cli-latency --repeats 3 --json $R/cli_latency.json
if [[ -z "$ONLY" || " $ONLY " == *" async_grpo "* ]]; then  # a module of its own, not a bench subcommand
  echo "== async_grpo: python -m distflow_lab.experiments.async_study --size full"
  .venv/bin/python -m distflow_lab.experiments.async_study --size full --json $R/async_grpo.json 2>&1 \
    | tee $R/logs/async_grpo.log | grep -v -E "INFO|it/s\]" || true
fi
