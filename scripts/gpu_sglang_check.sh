#!/bin/bash
# Checks the SGLang backend on one GPU: a bench against the native engine, then training.
#
# In one command (about 8 minutes on an H200):
#   1. bench: native engine vs SGLang 0.5.16, dense Qwen2.5-3B shape, 256 x 4,096 tokens,
#      in one process (--backend both) -> tokens/s of each and the native/SGLang ratio
#   2. train.py with engine.backend=sglang: tiny (2 rollouts) and the qwen3b_dense shape
#      (random Qwen2.5-3B weights, synthetic prompts, 2 rollouts): phase times, GPU memory,
#      and the sampler/dense mismatch metrics (only numerical noise expected: SGLang's
#      bf16 kernels vs the trainer's forward on the same weights).
# Run from the repo root on the GPU machine, with SGLang and DeepSpeed installed (or staged:
# .stage/deps, see ../shared/gpu/README.md; SGLang's parts must be installed beforehand):
#
#   bash scripts/gpu_sglang_check.sh                  # everything; logs under $OUT or /tmp
#   STEPS=bench bash scripts/gpu_sglang_check.sh      # only the bench (or STEPS=train;
#                                                      STEPS=train3b: only the 3B run)
#   REPEATS=3 bash scripts/gpu_sglang_check.sh        # timed bench repeats per backend
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import deepspeed" 2>/dev/null; then
    for part in .stage/deps/p*/; do bash "$part/install.sh" "$part"; done
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import sglang" || { echo "SGLang is not installed (requirements-gpu.txt)"; exit 2; }
LOGS=${OUT:-/tmp/gpu_sglang_check}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCH_CUDA_ARCH_LIST=9.0
STEPS=${STEPS:-bench,train}

if [[ $STEPS == *bench* ]]; then
    python3 -m minisparse.bench --backend both --model qwen2.5-3b --device cuda \
        --batch 256 --prompt-len 160 --max-new-tokens 4096 --repeats "${REPEATS:-1}" --warmup 32 \
        --json "$LOGS/bench_native_vs_sglang.json" 2>&1 | tee "$LOGS/bench.log"
fi

summary() {  # phase times / memory / mismatch of each rollout in a metrics.jsonl
    python3 -m scripts.phase_table "$1" --prefix mismatch/ --prefix tis/ --prefix rs/ \
        --key perf/rollout_tokens --key perf/rollout_tokens_per_s \
        --key rollout/response_len_mean --key train/grad_norm --key train/pg_loss
}

train() {  # NAME CONFIG OVERRIDES...
    local name=$1 config=$2
    shift 2
    rm -rf "$LOGS/$name"
    torchrun --standalone --nproc_per_node 1 train.py --config "$config" \
        --set engine.backend=sglang --set save_interval=0 --set resume=never \
        --set log.tensorboard=false --set output_dir="$LOGS/$name" "$@" \
        2>&1 | tee "$LOGS/$name.log"
    summary "$LOGS/$name/metrics.jsonl" | tee "$LOGS/$name.summary"
}

if [[ $STEPS == *train* ]] && [[ $STEPS != *train3b* ]]; then
    train tiny_sglang tiny_dense --set num_rollout=2 --set model.dtype=bfloat16
fi
if [[ $STEPS == *train* ]]; then
    train qwen3b_dense_sglang qwen3b_dense --set model.path=qwen2.5-3b \
        --set data.path=synthetic --set data.synthetic_size=256 --set num_rollout=2 \
        --set rollout_batch_size=16 --set n_samples_per_prompt=8 --set global_batch_size=64 \
        --set num_steps_per_rollout=2 --set max_response_len=1024 \
        --set max_tokens_per_gpu=4096 --set model.gradient_checkpointing=true
fi
