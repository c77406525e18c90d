#!/bin/bash
# The real Qwen2.5-Coder-Instruct models (0.5B, 1.5B) on a GPU: base scores, answer
# lengths, the training set's pass rate, exactness against transformers, and the dense /
# R-KV step pair on real weights beside random ones. Each argument is one job, run in
# order on the GPUs this process sees (CUDA_VISIBLE_DEVICES); start one queue per GPU:
#
#   CUDA_VISIBLE_DEVICES=0 bash scripts/gpu_real_model.sh convert:0.5b protocol:0.5b &
#   CUDA_VISIBLE_DEVICES=1 bash scripts/gpu_real_model.sh greedy:0.5b train:0.5b &
#   CUDA_VISIBLE_DEVICES=2 bash scripts/gpu_real_model.sh convert:1.5b pair:real &
#   CUDA_VISIBLE_DEVICES=3 bash scripts/gpu_real_model.sh pair:random exact:1.5b &
#
# Jobs (SIZE is 0.5b or 1.5b; a job waits until its model has been converted):
#   convert:SIZE   the GGUF ($GGUF_DIR/qwen2.5-coder-SIZE-instruct-q4_k_m.gguf, waited for)
#                  to a bf16 HF folder in $MODELS (python -m minisparse.download --gguf)
#   protocol:SIZE  eval.py on MATH500 and GSM8K, the paper's protocol (T 0.8, top-p 0.95,
#                  one sample of up to 8,192 tokens)
#   greedy:SIZE    the same, greedy
#   train:SIZE     the first $TRAIN_ROWS rows of the training file ($DATA), its own chat
#                  prompts, T 1.0 (the training temperature), up to $TRAIN_LEN tokens
#   exact:SIZE     tests/engine/test_gpu_real_model.py -k qwen: greedy engine tokens = HF generate
#   pair:real      scripts/dense_vs_sparse.sh: qwen1.5b_rkv and its dense twin, the
#                  paper's per-GPU batch (256 x 4,096), $PAIR_ROLLOUTS rollouts each, on
#                  the real 1.5B
#   pair:random    the same on random weights of the Qwen2.5-1.5B shape
#   ablation:VARIANT  scripts/ablation.sh --family coder1.5b, this one variant (dense,
#                  rkv_naive, rkv, rkv_geo, snapkv) of seed $SEED on this queue's GPU, up to
#                  $ROLLOUTS rollouts, stopped (and saved) by the clock time $UNTIL
#                  (seconds since the epoch; unset: no limit)
#   final:VARIANT[/B1,B2]  eval.py's protocol (--full: T 0.8, top-p 0.95, 8,192 tokens, 32
#                  samples of 16,384 on aime24 and amc23) on the newest checkpoint of that
#                  ablation run once its rollout $ROLLOUTS is saved (waited for; keep it:
#                  EXTRA="--set save_interval=30"), with the run's chat template, on the
#                  paper's seven benchmarks or the listed ones (split them over GPUs)
# Results: $ROOT/JOB (eval.py's folders, the pair's runs; JOB with _ for : / and ,),
# $ROOT/JOB.log.
# Settings (environment): MODELS (/tmp/models), GGUF_DIR (/tmp/files), DATA
# (data/simplelr_qwen_level3to5.jsonl), EVAL_DIR (data/eval), ROOT (/tmp/real),
# TRAIN_ROWS (512), TRAIN_LEN (4096), SEED (1), ROLLOUTS (30), UNTIL, PAIR_ROLLOUTS (3).
# On the GPU machine the staged wheels (.stage/deps) are installed first where deepspeed
# is missing.
case ${1:-} in -h|--help|"") sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
MODELS=${MODELS:-/tmp/models}; GGUF_DIR=${GGUF_DIR:-/tmp/files}; ROOT=${ROOT:-/tmp/real}
DATA=${DATA:-data/simplelr_qwen_level3to5.jsonl}; EVAL_DIR=${EVAL_DIR:-data/eval}
TRAIN_ROWS=${TRAIN_ROWS:-512}; TRAIN_LEN=${TRAIN_LEN:-4096}
SEED=${SEED:-1}; ROLLOUTS=${ROLLOUTS:-30}; UNTIL=${UNTIL:-}; PAIR_ROLLOUTS=${PAIR_ROLLOUTS:-3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$ROOT"

model_dir() { echo "$MODELS/qwen2.5-coder-$1-instruct"; }
wait_for() {  # path: until it exists (a conversion or a staged file still under way)
    until [ -e "$1" ]; do sleep 5; done
}
evaluate() {  # job size flags...: eval.py on the real model into $ROOT/job
    local job=$1 size=$2; shift 2
    wait_for "$(model_dir "$size")/config.json"
    python3 eval.py --model "$(model_dir "$size")" --data-dir "$EVAL_DIR" --no-progress \
        --set reward.workers=4 --output "$ROOT/${job//:/_}" "$@"
}
pair() {  # job model port
    ROOT="$ROOT/${1//:/_}" CONFIG=qwen1.5b_rkv MODEL=$2 DATA=$DATA AT_ONCE=0 PORT=$3 \
        ROLLOUTS=$PAIR_ROLLOUTS bash scripts/dense_vs_sparse.sh
}

job_name() { local n=${1//[:\/]/_}; echo "${n//,/_}"; }  # a file name: final:dense/a,b -> final_dense_a_b
run_job() {
    local job=$1 size=${1#*:}
    case $job in
        convert:*)
            local gguf="$GGUF_DIR/qwen2.5-coder-$size-instruct-q4_k_m.gguf"
            wait_for "$gguf"
            python3 -m minisparse.download --model "qwen2.5-coder-$size-instruct" \
                --gguf "$gguf" --out "$MODELS" ;;
        protocol:*) evaluate "$job" "$size" --benchmarks math500,gsm8k ;;
        greedy:*) evaluate "$job" "$size" --benchmarks math500,gsm8k --temperature 0 ;;
        train:*) evaluate "$job" "$size" --benchmarks "$DATA" --limit "$TRAIN_ROWS" \
                     --temperature 1.0 --top-p 1.0 --max-new-tokens "$TRAIN_LEN" ;;
        exact:*)
            wait_for "$(model_dir "$size")/config.json"
            MINISPARSE_QWEN="$(model_dir "$size")" MINISPARSE_MATH500="$PWD/$EVAL_DIR/math500/test.jsonl" \
                python3 -m pytest -q -s -p no:cacheprovider tests/engine/test_gpu_real_model.py -k qwen ;;
        pair:real) wait_for "$(model_dir 1.5b)/config.json"; pair "$job" "$(model_dir 1.5b)" 29641 ;;
        pair:random) pair "$job" qwen2.5-1.5b 29631 ;;
        ablation:*)
            local variants=(dense rkv_naive rkv rkv_geo snapkv) index
            for index in "${!variants[@]}"; do [ "${variants[$index]}" = "$size" ] && break; done
            wait_for "$(model_dir 1.5b)/config.json"  # before the clock: UNTIL is an end time
            local seconds=$(( ${UNTIL:-0} > 0 ? UNTIL - $(date +%s) : 86400 ))
            BASE="$(model_dir 1.5b)" bash scripts/ablation.sh --family coder1.5b \
                --variants "$size" --seeds "$SEED" --rollouts "$ROLLOUTS" --kv-gb 0 \
                --micro-tokens 16384 --gpus "${CUDA_VISIBLE_DEVICES:-0}" \
                --port $((29650 + index)) --train-s "$seconds" --grace-s 60 \
                --root "$ROOT/ablation" ;;
        final:*)
            local variant=${size%%/*} list=${size#*/}
            [[ $size == */* ]] || list=$(python3 -c "from minisparse.data.benchmarks import \
PAPER_BENCHMARKS as names; print(','.join(names))")
            local run="$ROOT/ablation/${variant}_seed$SEED"
            wait_for "$run/checkpoints/rollout_$(printf %06d "$ROLLOUTS")/COMPLETE"
            python3 eval.py --run "$run" --full --no-base \
                --no-progress --set eval.benchmarks="$list" --set eval.data_dir="$EVAL_DIR" \
                --set reward.workers=4 --output "$ROOT/$(job_name "$job")" ;;
        *) echo "unknown job '$job' (see --help)" >&2; return 2 ;;
    esac
}

if ! python3 -c "import deepspeed, math_verify" 2>/dev/null; then
    for part in .stage/deps/p*/; do [ -d "$part" ] && bash "$part/install.sh" "$part"; done
fi
for job in "$@"; do
    name=$(job_name "$job")
    start=$(date +%s)
    echo "$(date +%T) $job: start (GPU ${CUDA_VISIBLE_DEVICES:-all})"
    run_job "$job" > "$ROOT/$name.log" 2>&1
    status=$?
    echo "$(date +%T) $job: exit $status after $(( $(date +%s) - start )) s (log $ROOT/$name.log)"
done
