#!/bin/bash
# Trains a paper config on several GPUs in time-limited calls, interrupted and resumed.
#
# Every call trains CONFIG with a checkpoint after each rollout, until ROLLOUTS are done,
# STOP_AFTER's checkpoint is complete (then it interrupts the run with SIGINT, as a user's
# Ctrl-C or a scheduler would), or LIMIT_S seconds (default 560) have passed.
# The next call with RESUME=1 continues from the newest complete checkpoint (--resume).
# After each call it prints every rollout's phase times, memory per phase and MFU, and
# checks that metrics.jsonl has each rollout once, in order, across the calls.
#
#   # qwen3b_rkv: 2 rollouts, interrupted during the 3rd; then resumed to 3 (and evaluated)
#   STOP_AFTER=2 bash scripts/gpu_paper_configs.sh
#   RESUME=1 EVAL_EVERY=3 bash scripts/gpu_paper_configs.sh
#   # qwen7b_rkv with the paper's settings (ZeRO stage from the config, or ZERO=3)
#   CONFIG=qwen7b_rkv MODEL=qwen2.5-7b ROLLOUTS=2 bash scripts/gpu_paper_configs.sh
#
# Needs data/simplelr_qwen_level3to5.jsonl (python -m minisparse.download --dataset
# simplelr_qwen_level3to5 --out data/, or a copy carried to the machine) and, with
# EVAL_EVERY, data/eval/math500/test.jsonl. MODEL: a shape name (random weights) or an HF
# directory. On the CPU (the script's own check): CONFIG=tiny_rkv MODEL=tiny NPROC=2.
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-qwen3b_rkv}
MODEL=${MODEL:-qwen2.5-3b}
NPROC=${NPROC:-4}
ROLLOUTS=${ROLLOUTS:-3}
LIMIT_S=${LIMIT_S:-560}
RUN_DIR=${RUN_DIR:-outputs/accept_$CONFIG}
if ! python3 -c "import deepspeed" 2>/dev/null; then
    for part in .stage/deps/p*/; do bash "$part/install.sh" "$part"; done
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
LOG=${OUT:-$RUN_DIR}/train_$(date +%H%M%S).log
mkdir -p "$RUN_DIR" "$(dirname "$LOG")"

args=(--config "$CONFIG" --set model.path="$MODEL" --set num_rollout="$ROLLOUTS"
      --set output_dir="$RUN_DIR" --set save_interval=1 --set log.tensorboard=false)
[ -n "${ZERO:-}" ] && args+=(--set zero_stage="$ZERO")
[ -n "${EVAL_EVERY:-}" ] && args+=(--set eval_interval="$EVAL_EVERY"
    --set "eval.benchmarks=[${EVAL_BENCH:-math500}]" --set eval.limit="${EVAL_LIMIT:-64}"
    --set eval.max_new_tokens="${EVAL_TOKENS:-2048}" --set eval.n_samples=1)
if [ "${RESUME:-0}" = 1 ]; then args+=(--resume); else args+=(--set resume=never); fi

timeout -s INT "$LIMIT_S" torchrun --standalone --nproc_per_node "$NPROC" train.py \
    "${args[@]}" ${EXTRA:-} > "$LOG" 2>&1 &
run=$!
newest() {  # rollout number of the newest complete checkpoint (0: none)
    local n=0 c
    for c in "$RUN_DIR"/checkpoints/rollout_*/COMPLETE; do
        [ -f "$c" ] && c=${c%/COMPLETE} && n=$((10#${c##*_}))
    done
    echo $n
}
if [ -n "${STOP_AFTER:-}" ]; then  # Ctrl-C once that checkpoint is complete, mid next rollout
    while kill -0 $run 2>/dev/null && [ "$(newest)" -lt "$STOP_AFTER" ]; do sleep 0.5; done
    sleep "${STOP_DELAY_S:-20}"
    kill -INT $run && echo "interrupted with SIGINT after checkpoint rollout $(newest) was complete"
fi
wait $run
echo "train exit $? (log: $LOG)"; tail -3 "$LOG"

[ -f "$RUN_DIR/metrics.jsonl" ] && python3 -m scripts.phase_table "$RUN_DIR/metrics.jsonl" \
    --prefix perf/ --prefix eval/ --key rollout/response_len_mean \
    --key compress/peak_cache_tokens_mean --key mismatch/kl_k1 --key rs/kept_token_frac
python3 - "$RUN_DIR" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
metrics = run / "metrics.jsonl"
got = [json.loads(line)["rollout"] for line in open(metrics)] if metrics.exists() else []
print(f"rollouts in metrics.jsonl: {got} -> "
      + ("continuous" if got == list(range(1, len(got) + 1)) else "NOT CONTINUOUS"))
ckpts = sorted(p.name for p in (run / "checkpoints").glob("rollout_*") if (p / "COMPLETE").exists())
print(f"complete checkpoints: {ckpts}")
PY
