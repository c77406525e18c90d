#!/bin/bash
# A lost rank with NCCL on two GPUs: two torchruns as two nodes on this machine, one GPU
# each (scripts/peer_loss.py). Node 1's worker is frozen (SIGSTOP) or killed (SIGKILL) as
# rollout 2 or its update starts; `sigterm`: node 1 dies, then node 0 gets SIGTERM. Per
# case: node 0's exit code, seconds from the signal to its exit (expected: the peer
# timeout plus seconds; sigterm: the stop's limit, 15 s, plus seconds), its last line
# and the resume's rollouts (1 2 3); then whether any process still holds a GPU.
#
#   bash scripts/gpu_peer_loss.sh                      # SIGSTOP as rollout 2 starts
#   CASES="SIGKILL update" bash scripts/gpu_peer_loss.sh
#   CASES=sigterm bash scripts/gpu_peer_loss.sh
#   CASES="SIGTERM logprobs" bash scripts/gpu_peer_loss.sh
#
# A case takes a few minutes (two start-ups, the wait, the resume, a 22 GB checkpoint a
# rollout); CASES="a,b" runs several. Settings (environment): CASES ("SIGSTOP rollout";
# scripts/peer_loss.py --help lists all), PEER_TIMEOUT (dist.peer_timeout_s, 30; runs
# default to 120), CONFIG (qwen1.5b_rkv), MODEL (a shape name for random weights, or an
# HF directory; qwen2.5-1.5b), LEN (max_response_len, 256), PROMPTS (prompts a rollout,
# 8), OUT (/tmp/gpu_peer_loss, made fresh), EXTRA (more --set KEY=VALUE words).
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
CASES=${CASES:-SIGSTOP rollout}; PEER_TIMEOUT=${PEER_TIMEOUT:-30}
CONFIG=${CONFIG:-qwen1.5b_rkv}; MODEL=${MODEL:-qwen2.5-1.5b}; LEN=${LEN:-256}
PROMPTS=${PROMPTS:-8}; OUT=${OUT:-/tmp/gpu_peer_loss}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if ! python3 -c "import deepspeed" 2>/dev/null; then  # the carried wheels (.stage/deps)
    for part in .stage/deps/p*/; do bash "$part/install.sh" "$part"; done
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$GPUS" -lt 2 ]; then echo "error: needs 2 GPUs, sees $GPUS" >&2; exit 2; fi
SAMPLES=$(python3 -c "from minisparse.config.load import load_config as l
print($PROMPTS * l('$CONFIG').n_samples_per_prompt)") || exit 2
rm -rf "$OUT"
# one optimizer step a rollout over all samples; one checkpoint kept (a 1.5B one is 22 GB)
python3 -m scripts.peer_loss --out "$OUT" --config "$CONFIG" --peer-timeout "$PEER_TIMEOUT" \
    --cases "$CASES" --gpus --set model.path="$MODEL" --set data.path=synthetic \
    --set max_response_len="$LEN" --set rollout_batch_size="$PROMPTS" \
    --set global_batch_size="$SAMPLES" --set num_steps_per_rollout=1 \
    --set save_total_limit=1 --set log.tensorboard=false \
    $(for word in ${EXTRA:-}; do printf -- '--set %s ' "$word"; done)
status=$?
echo "--- processes on the GPUs after the cases (none expected):"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader
rm -rf "$OUT"/*/checkpoints
exit $status
