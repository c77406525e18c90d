#!/bin/bash
# Runs the Sparse-RL ablation in miniature: four SmolLM2-135M runs at once on one GPU, scored.
#
# SmolLM2-135M-Instruct on the generated arithmetic set (docs/results.md), four runs AT
# ONCE on one GPU (135M fits many times), each its own process, MASTER_PORT and output
# dir: dense; R-KV with every correction off; R-KV with the Sparse-RL corrections; SnapKV
# with them. Each trains for TRAIN_S seconds at most (or ROLLOUTS rollouts), then its
# newest checkpoint is scored on the held-out arithmetic benchmark; the dense run's and
# the base model's also compressed (robustness).
#
#   bash scripts/smollm2_ablation.sh                 # needs checkpoints/smollm2-135m-instruct
#   TRAIN_S=1800 ROLLOUTS=60 bash scripts/smollm2_ablation.sh
#   EVAL=0 ...; then TRAIN=0 ... # train in one command, score in the next (or resume)
#   PACK=$OUT/ablation.tgz bash scripts/smollm2_ablation.sh   # metrics, logs, evals packed
#       on any exit, also when a time limit stops it (checkpoints and TensorBoard left out)
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=${ROOT:-outputs/ablation}
TRAIN_S=${TRAIN_S:-280}
ROLLOUTS=${ROLLOUTS:-80}
KV_GB=${KV_GB:-6}
BASE=${BASE:-checkpoints/smollm2-135m-instruct}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$ROOT"
[ -n "${PACK:-}" ] && trap 'tar czf "$PACK" --exclude=checkpoints --exclude=tensorboard "$ROOT"' EXIT
NAIVE="--set loss.use_tis=false --set loss.use_rs=false --set loss.normalize_weights=false"

train() {  # name port config [overrides]
    local name=$1 port=$2 config=$3; shift 3
    MASTER_PORT=$port timeout -s INT "$TRAIN_S" python train.py --config "$config" \
        --set output_dir="$ROOT/$name" --set num_rollout="$ROLLOUTS" --set save_interval=3 \
        --set engine.kv_memory_gb="$KV_GB" --set model.path="$BASE" "$@" ${EXTRA:-} \
        > "$ROOT/$name.log" 2>&1
    echo "$name: train exit $?"
}
VARIANTS=${VARIANTS:-dense rkv_naive rkv snapkv}
on() { [[ " $VARIANTS " == *" $1 "* ]]; }
if [ "${TRAIN:-1}" = 1 ]; then  # a second command with the same ROOT resumes each run
    on dense && train dense 29501 smollm2_dense &
    on rkv_naive && train rkv_naive 29502 smollm2_rkv $NAIVE &
    on rkv && train rkv 29503 smollm2_rkv &
    on snapkv && train snapkv 29504 smollm2_snapkv &
    wait
fi
[ "${EVAL:-1}" = 1 ] || exit 0

evaluate() {  # label model config
    timeout "${EVAL_S:-3600}" python eval.py --config "$3" --model "$2" --benchmarks arithmetic --prompt-template user \
        --max-new-tokens 512 --n-samples "${EVAL_N:-2}" --kv-memory-gb "$KV_GB" --no-progress \
        ${EVAL_LIMIT:+--limit $EVAL_LIMIT} ${EVAL_EXTRA:-} \
        --output "$ROOT/heldout/$1" > "$ROOT/heldout_$1.log" 2>&1
    echo "$1: eval exit $?"
}
newest() { ls -d "$ROOT/$1"/checkpoints/rollout_* 2>/dev/null | tail -1; }
mkdir -p "$ROOT/heldout"
for name in $VARIANTS; do
    ck=$(newest $name)
    [ -n "$ck" ] && evaluate "${name}_$(basename "$ck")" "$ck/hf" smollm2_dense &
done
ck=$(newest dense)
for c in rkv snapkv; do
    [ -z "${SKIP_BASE:-}" ] && evaluate "base_$c" "$BASE" smollm2_$c &
    on dense && [ -n "$ck" ] && evaluate "dense_$(basename "$ck")_$c" "$ck/hf" smollm2_$c &
done
[ -z "${SKIP_BASE:-}" ] && evaluate base_dense "$BASE" smollm2_dense &
wait
