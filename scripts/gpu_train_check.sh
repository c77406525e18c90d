#!/bin/bash
# Three rollouts + updates of qwen3b_rkv-shaped training on one GPU (DeepSpeed ZeRO 2),
# random Qwen2.5-3B weights (model.path=qwen2.5-3b), synthetic prompts, fewer of them.
# Prints each phase's time, peak and end-of-phase GPU memory. AdamW states exist only after
# the first step, so rollout 2 is the first full swap (and page-locks host memory once);
# rollout 3 is the steady state. The lead records them in docs/benchmarks.md.
# Run from the repo root on the GPU machine (about 3.5 minutes on one H100):
#
#   bash scripts/gpu_train_check.sh                    # defaults below
#   bash scripts/gpu_train_check.sh --set max_response_len=2048   # extra overrides
#   NPROC=4 bash scripts/gpu_train_check.sh            # torchrun over 4 GPUs
#
# DeepSpeed is installed from .stage/deps (the lead's staged wheels) when missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import deepspeed" 2>/dev/null; then
    for part in .stage/deps/p*/; do bash "$part/install.sh" "$part"; done
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
OUT_DIR=${OUT_DIR:-/tmp/gpu_train_check}
rm -rf "$OUT_DIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
torchrun --standalone --nproc_per_node "${NPROC:-1}" train.py --config qwen3b_rkv \
    --set model.path=qwen2.5-3b --set data.path=synthetic --set data.synthetic_size=256 \
    --set num_rollout=3 --set rollout_batch_size=16 --set n_samples_per_prompt=8 \
    --set global_batch_size=64 --set num_steps_per_rollout=2 --set max_response_len=1024 \
    --set max_tokens_per_gpu=16384 --set model.gradient_checkpointing=true \
    --set save_interval=0 --set resume=never \
    --set log.tensorboard=false --set output_dir="$OUT_DIR" "$@"
python3 scripts/phase_table.py "$OUT_DIR/metrics.jsonl" --prefix perf/ \
    --key rollout/response_len_mean --key compress/compressions_per_sample \
    --key train/micro_batches --key train/grad_norm --key train/pg_loss \
    --key rs/kept_token_frac --key mismatch/kl_k3
