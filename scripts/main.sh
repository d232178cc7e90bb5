#!/usr/bin/env bash
# Set up (if needed), then the main job: a small GRPO run (tiny Qwen2, SFT warm
# start, arithmetic task) on an embedded local Ray cluster on CPU. Prints the
# reward per step; writes metrics, spans, a Perfetto trace and an HTML report
# to a new runs/tiny-cpu-grpo/run-NNN/. Extra arguments go to `distflow-lab run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/distflow-lab run tiny-cpu-grpo "$@"
