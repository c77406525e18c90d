#!/bin/bash
# The Sparse-RL ablation: seeds x variants of one family of configs (FAMILY_dense,
# FAMILY_rkv, FAMILY_snapkv), every run at once, spread over the machine's GPUs
# (docs/results.md). Families: smollm2 (SmolLM2-135M-Instruct adding single digits, the
# default: a dozen runs share one GPU) and coder1.5b (Qwen2.5-Coder-1.5B-Instruct on the
# paper's MATH set, one run a GPU).
#
# Every (variant, seed) run is its own train.py process with its own MASTER_PORT and
# output dir ROOT/VARIANT_seedN, all started together, run i on the i-th GPU of GPU_LIST
# (round robin). Each
# trains to ROLLOUTS rollouts, so every run ends at the same rollout whatever its speed,
# and scores itself on its config's held-out benchmarks (dense cache, the same for every
# variant) every EVAL_EVERY rollouts: metrics.jsonl's eval/* rows are the results, no
# scoring phase.
# A command stops each run TRAIN_S seconds after it started (SIGTERM: it finishes the
# rollout under way and saves; killed GRACE_S later if still running); the same command
# again resumes every unfinished run and skips the finished ones. At the end it prints
# each run's progress and the results tables (python -m minisparse.plot --group --table).
#
# Variants: dense (FAMILY_dense); rkv_naive (FAMILY_rkv, every correction off); rkv
# (FAMILY_rkv: R-KV + Sparse-RL: token TIS, token rejection, veto, normalised); rkv_geo
# (R-KV, token TIS + geometric rejection: a sequence leaves whole when the geometric mean
# of its ratios leaves the same [0.5, 1.5], no veto: the sequence-masked form verl and
# TRL default to); snapkv (FAMILY_snapkv: SnapKV + Sparse-RL); rkv_keep_prompt (rkv with
# compress.keep_prompt: the prompt is never evicted); lora (dense with LoRA adapters of
# rank LORA_RANK on every linear layer, lr LORA_LR: model.lora, docs/training.md).
#
#   bash scripts/ablation.sh                                  # smollm2: 3 seeds x 5 variants
#   bash scripts/ablation.sh --seeds "1 2 3" --variants "dense rkv" --rollouts 60
#   bash scripts/ablation.sh --family coder1.5b --seeds 1 --variants "dense rkv_naive rkv rkv_geo" \
#       --rollouts 30 --kv-gb 0 --micro-tokens 16384       # one run on each of 4 GPUs
#   bash scripts/ablation.sh --family coder1.5b --seeds 1 --variants "dense rkv_naive rkv snapkv" \
#       --rollouts 100 --eval-every 20 --kv-gb 0 --micro-tokens 16384 --train-s 480 \
#       --records docs/runs/real/100_rollouts   # the paper's length; again until every run ends
#   bash scripts/ablation.sh --dry-run                        # the train.py commands only
#
# Options (or the environment variable in capitals; default in brackets):
#   --family NAME      FAMILY      the configs NAME_dense, NAME_rkv, NAME_snapkv [smollm2]
#   --seeds LIST       SEEDS       seeds, space- or comma-separated ["1 2 3"]
#   --variants LIST    VARIANTS    ["dense rkv_naive rkv rkv_geo snapkv"]
#   --rollouts N       ROLLOUTS    rollouts of every run [50]
#   --eval-every N     EVAL_EVERY  held-out evaluation every N rollouts [10]
#   --train-s S        TRAIN_S     seconds each run trains in this command [450]
#   --grace-s S        GRACE_S     after TRAIN_S, seconds to finish the rollout and save [90]
#   --root DIR         ROOT        where the runs go [outputs/ablation]
#   --kv-gb G          KV_GB       each run's rollout KV pool in GiB; 0: the config's share
#                                  of the free GPU memory [1]
#   --micro-tokens N   MICRO_TOKENS  max_tokens_per_gpu of every run [2048]
#   --pack FILE        PACK        on exit, a .tgz of ROOT without checkpoints and TensorBoard
#   --records DIR      RECORDS     on exit, each run's records in DIR/VARIANT_seedN: metrics
#                                  and graded samples cut to what pairing needs
#                                  (scripts/keep_records.py; docs/runs/real/ was kept so)
#   --port N           PORT        first MASTER_PORT; run i takes PORT + i [29600]
#   --gpus LIST        GPU_LIST    the GPUs the runs go on, e.g. "2 3" [every GPU]
#   --dry-run                      print each run's command and exit
#   EXTRA="--set k=v ..."          added to every run's train.py command
#   LORA_RANK, LORA_LR             lora's adapter rank and learning rate [16, 1e-4]
#   BASE=DIR                       the model [the family's model.path]
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
FAMILY=${FAMILY:-smollm2}
SEEDS=${SEEDS:-1 2 3}
VARIANTS=${VARIANTS:-dense rkv_naive rkv rkv_geo snapkv}
LORA_RANK=${LORA_RANK:-16}
LORA_LR=${LORA_LR:-1e-4}
ROLLOUTS=${ROLLOUTS:-50}
EVAL_EVERY=${EVAL_EVERY:-10}
TRAIN_S=${TRAIN_S:-450}
GRACE_S=${GRACE_S:-90}
ROOT=${ROOT:-outputs/ablation}
KV_GB=${KV_GB:-1}
MICRO_TOKENS=${MICRO_TOKENS:-2048}  # small micro-batches: a dozen runs' activations on one GPU
PACK=${PACK:-}
RECORDS=${RECORDS:-}
PORT=${PORT:-29600}
BASE=${BASE:-}
DRY=0
while [ $# -gt 0 ]; do
    case $1 in
        --family) FAMILY=$2; shift ;;
        --seeds) SEEDS=$2; shift ;;
        --variants) VARIANTS=$2; shift ;;
        --rollouts) ROLLOUTS=$2; shift ;;
        --eval-every) EVAL_EVERY=$2; shift ;;
        --train-s) TRAIN_S=$2; shift ;;
        --grace-s) GRACE_S=$2; shift ;;
        --root) ROOT=$2; shift ;;
        --kv-gb) KV_GB=$2; shift ;;
        --micro-tokens) MICRO_TOKENS=$2; shift ;;
        --pack) PACK=$2; shift ;;
        --records) RECORDS=$2; shift ;;
        --port) PORT=$2; shift ;;
        --gpus) GPU_LIST=$2; shift ;;
        --dry-run) DRY=1 ;;
        *) echo "ablation.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
SEEDS=${SEEDS//,/ }
VARIANTS=${VARIANTS//,/ }
for n in "$ROLLOUTS" "$EVAL_EVERY" "$TRAIN_S" "$GRACE_S" "$PORT" "$MICRO_TOKENS" $SEEDS; do
    [[ $n =~ ^[0-9]+$ ]] || { echo "ablation.sh: '$n' is not a whole number" >&2; exit 2; }
done

NAIVE="--set loss.use_tis=false --set loss.use_rs=false --set loss.normalize_weights=false"
variant_args() {  # the config and overrides of one variant
    case $1 in
        dense) echo "--config ${FAMILY}_dense" ;;
        rkv_naive) echo "--config ${FAMILY}_rkv $NAIVE" ;;
        rkv) echo "--config ${FAMILY}_rkv" ;;
        rkv_geo) echo "--config ${FAMILY}_rkv --set loss.rs_level=geometric" \
                      "--set loss.rs_veto_threshold=0" ;;
        snapkv) echo "--config ${FAMILY}_snapkv" ;;
        rkv_keep_prompt) echo "--config ${FAMILY}_rkv --set compress.keep_prompt=true" ;;
        lora) echo "--config ${FAMILY}_dense --set model.lora.enabled=true" \
                   "--set model.lora.rank=$LORA_RANK --set optim.lr=$LORA_LR" ;;
        *) return 1 ;;
    esac
}
for v in $VARIANTS; do
    variant_args "$v" > /dev/null || {
        echo "ablation.sh: unknown variant '$v' (dense rkv_naive rkv rkv_geo" \
             "snapkv rkv_keep_prompt lora)" >&2; exit 2; }
done
for v in dense rkv; do
    [ -f "configs/${FAMILY}_$v.yaml" ] || {
        echo "ablation.sh: unknown family '$FAMILY' (no configs/${FAMILY}_$v.yaml)" >&2; exit 2; }
done
if [ -z "$BASE" ]; then
    # the dense config's model.path, its bases resolved
    BASE=$(python3 -c "import sys; from minisparse.config.load import load_config; \
print(load_config(sys.argv[1]).model.path)" "${FAMILY}_dense")
fi
[ -d "$BASE" ] || [ $DRY = 1 ] || {
    echo "ablation.sh: no model at $BASE (python -m minisparse.download --model" \
         "NAME --out checkpoints/, or BASE=DIR)" >&2; exit 2; }

RUNS=$(( $(wc -w <<< "$SEEDS") * $(wc -w <<< "$VARIANTS") ))
if [ $DRY = 0 ]; then  # run i listens on PORT + i: a port taken fails that run with a traceback
    busy=$(python3 -m scripts.ports $(seq "$PORT" $((PORT + RUNS - 1)))) || {
        echo "ablation.sh: port $busy is in use, by another run perhaps: --port N sets the" \
             "first of the $RUNS ports" >&2; exit 2; }
fi

export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ $DRY = 0 ] && ! python3 -c "import deepspeed" 2>/dev/null; then
    # the GPU machine: the wheels ../shared/gpu/stage.py staged (deps/pNN), if carried
    for part in .stage/deps/p*/; do [ -d "$part" ] && bash "$part/install.sh" "$part"; done
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ -z "${GPU_LIST:-}" ]; then
    count=$(nvidia-smi -L 2>/dev/null | wc -l)
    GPU_LIST=$(seq -s " " 0 $(( (count > 0 ? count : 1) - 1 )))
fi
read -r -a GPU_ARRAY <<< "${GPU_LIST//,/ }"
GPUS=${#GPU_ARRAY[@]}
# the runs' CPU threads share the machine's cores rather than each taking them all
THREADS=$(( $(nproc) / RUNS ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( THREADS > 0 ? THREADS : 1 ))}
mkdir -p "$ROOT"
on_exit() {  # what leaves the machine: the pack, the records
    [ -n "$PACK" ] && tar czf "$PACK" --exclude=checkpoints --exclude=tensorboard "$ROOT"
    local run runs=()
    for run in "${NAMES[@]}"; do [ -d "$ROOT/$run" ] && runs+=("$ROOT/$run"); done
    [ -n "$RECORDS" ] && [ ${#runs[@]} -gt 0 ] && python3 -m scripts.keep_records "${runs[@]}" \
        --out "$RECORDS"
    return 0
}
NAMES=()
for seed in $SEEDS; do for v in $VARIANTS; do NAMES+=("${v}_seed$seed"); done; done
[ $DRY = 0 ] && trap on_exit EXIT

finished() { [ -f "$ROOT/$1/checkpoints/rollout_$(printf %06d "$ROLLOUTS")/COMPLETE" ]; }

train() {  # name gpu port seed variant
    local name=$1 gpu=$2 port=$3 seed=$4
    local cmd="python train.py $(variant_args "$5") --set output_dir=$ROOT/$name"
    cmd+=" --set seed=$seed --set num_rollout=$ROLLOUTS --set eval_interval=$EVAL_EVERY"
    cmd+=" --set save_interval=$EVAL_EVERY --set save_total_limit=1"
    [ "$KV_GB" != 0 ] && cmd+=" --set engine.kv_memory_gb=$KV_GB"
    cmd+=" --set max_tokens_per_gpu=$MICRO_TOKENS"
    cmd+=" --set model.path=$BASE ${EXTRA:-}"
    if [ $DRY = 1 ]; then
        echo "CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$port $cmd"
        return
    fi
    # shellcheck disable=SC2086  # the command's words split as written
    CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$port timeout --preserve-status -s TERM -k "$GRACE_S" \
        "$TRAIN_S" $cmd >> "$ROOT/$name.log" 2>&1
    echo "$name: exit $? after rollout $(last_rollout "$name") of $ROLLOUTS"
}
last_rollout() {  # the newest rollout in a run's metrics.jsonl
    tail -n 1 "$ROOT/$1/metrics.jsonl" 2>/dev/null | sed -n 's/^{"rollout": \([0-9]*\).*/\1/p'
}

i=0
for seed in $SEEDS; do
    for v in $VARIANTS; do
        name=${v}_seed$seed
        if finished "$name"; then
            echo "$name: finished ($ROLLOUTS rollouts)"
        elif [ $DRY = 1 ]; then
            train "$name" "${GPU_ARRAY[i % GPUS]}" $((PORT + i)) "$seed" "$v"
        else
            train "$name" "${GPU_ARRAY[i % GPUS]}" $((PORT + i)) "$seed" "$v" &
        fi
        i=$((i + 1))
    done
done
wait
[ $DRY = 1 ] && exit 0
runs=()
for name in "${NAMES[@]}"; do [ -f "$ROOT/$name/metrics.jsonl" ] && runs+=("$ROOT/$name"); done
[ ${#runs[@]} -gt 0 ] && python -m minisparse.plot "${runs[@]}" --group --table \
    --out "$ROOT/ablation.png" | tee "$ROOT/results.md"
