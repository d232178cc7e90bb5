#!/usr/bin/env bash
# GPU smoke check: the first thing to run on a GPU node.
#
# NOT RUN ON A GPU YET: this project is developed on CPU-only machines. vLLM itself runs there (its
# CPU build), and the same pass criteria run on CPU in the suite (tests/test_vllm.py); this script
# is their first run on CUDA. Please report what it prints.
#
# 1. tests/test_vllm.py on this machine's vLLM (the GPU build when CUDA is there): greedy tokens equal
#    transformers' after a sync; fp32 log-probs within 1e-4 of the trainer's; reloading the same
#    weights changes nothing, perturbed ones change the output, a partial sync is an error; a bf16
#    engine shows a real mismatch. About 1 minute.
# 2. Two GRPO steps of a tiny random-init Qwen2 (fp32 master weights, bf16 compute and rollout) with
#    the vLLM rollout (in-process external launcher, tensor parallel over 2 GPUs if there are 2, sleep
#    mode, bucketed weight sync) and FSDP2 training over NCCL, on 1 or 2 local GPUs. Passes when both
#    steps finish, every worker synced its weights in both steps (a "weight_sync" span with bytes > 0),
#    the responses are not empty and the bf16 rollout's log-probs stay within 0.1 (mean |difference|)
#    of the trainer's. About 5 minutes, most of it vLLM's start-up.
# Needs a CUDA GPU and the [gpu] extra in the venv: .venv/bin/pip install -e '.[gpu]'. Outputs go to
# $OUT (default runs/gpu-check); the whole script stays under 9 minutes (timeouts below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/gpu-check}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DISTFLOW_HOME=${DISTFLOW_HOME:-$PWD/runs/gpu-check-home}  # its own tiny model and data

"$PY" - <<'EOF' || { echo "gpu_check: needs a CUDA GPU, a CUDA build of torch and vLLM (pip install -e '.[gpu]')" >&2; exit 1; }
import torch, vllm
assert torch.cuda.is_available(), "no CUDA device visible"
print(f"torch {torch.__version__}, vLLM {vllm.__version__}, {torch.cuda.device_count()} GPU(s): "
      f"{torch.cuda.get_device_name(0)}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
NGPU=$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()))")

CI=1 timeout 180 "$PY" -m pytest -q tests/test_vllm.py  # the criteria the CPU suite checks, on this vLLM

timeout 330 "$(dirname "$PY")/distflow-lab" run tiny-cpu-grpo --steps 2 --out "$OUT" --overwrite \
  model.path=models/tiny-qwen2-hd64-gpu-check model.dtype=float32 model.compute_dtype=bfloat16 \
  rollout.dtype=bfloat16 model.warm_start.steps=0 \
  model.tiny.hidden_size=256 model.tiny.num_heads=4 model.tiny.num_kv_heads=2 model.tiny.intermediate_size=512 \
  data.prompts_per_step=16 rollout.engine=vllm rollout.n=4 rollout.tp="$NGPU" rollout.log_probs=true \
  rollout.vllm.enforce_eager=true rollout.vllm.gpu_memory_utilization=0.2 rollout.vllm.kv_cache_gib=1 \
  weight_sync.bucket_mib=1 \
  cluster.world_size="$NGPU" cluster.gpus_per_worker=1 cluster.cpus_per_worker=2 cluster.stage_timeout_s=600

"$PY" - "$OUT" "$NGPU" <<'EOF'
import sys
import pandas as pd

out, ngpu = sys.argv[1], int(sys.argv[2])
metrics, spans = pd.read_parquet(f"{out}/metrics.parquet"), pd.read_parquet(f"{out}/spans.parquet")
sync = spans[spans.phase == "weight_sync"]
print(sync.groupby(["step", "worker"])[["seconds", "bytes", "items"]].sum().to_string())
assert len(metrics) == 2, f"expected 2 steps, got {len(metrics)}"
assert sync.groupby("worker")["step"].nunique().eq(2).all() and sync["worker"].nunique() == ngpu, \
    "every worker must sync its weights in both steps"
assert (sync["bytes"] > 0).all(), "a weight sync moved no bytes"
assert (metrics["response_length/mean"] > 0).all(), "empty responses"
diff = metrics["rollout/logprob_diff_mean"]
assert (diff < 0.1).all(), f"bf16 rollout vs trainer log-probs: mean |difference| {diff.tolist()} (bound 0.1)"
print(f"gpu_check: OK ({ngpu} GPU(s); weight sync {sync['seconds'].median():.3f} s, "
      f"{sync['bytes'].median() / 2**20:.1f} MiB per worker and step; mismatch mean {diff.max():.2e})")
EOF
