#!/bin/bash
# What sparse rollouts buy per step: the same GRPO step run twice, with the config's
# compressed rollouts and with dense ones (compress.algorithm=none), then each run's phase
# times and the step-time ratio dense / compressed of the last rollout (from ROLLOUTS=3
# on, also of the medians over rollouts 2 to ROLLOUTS).
#
#   bash scripts/dense_vs_sparse.sh                            # qwen3b_rkv, 3B shape, 4k, 256 samples
#   LEN=8192 bash scripts/dense_vs_sparse.sh                    # 8,192 new tokens
#   LEN=16384 PROMPTS=16 bash scripts/dense_vs_sparse.sh        # 128 samples of 16k
#   CONFIG=tiny_rkv MODEL=tiny DATA=synthetic LEN=64 PROMPTS=2 ROLLOUTS=1 \
#       bash scripts/dense_vs_sparse.sh                         # a CPU check, seconds
#
# With two GPUs or more the runs go at once (GPU 0 compressed, GPU 1 dense, each its own
# port); otherwise one after the other. At once, the two runs share one host's cores and
# memory, so either may be slowed by the other: AT_ONCE=0 runs them one after the other
# on GPU 0, with nothing beside them. RUNS=sparse, then RUNS=dense later,
# splits the pair over two jobs (each under a time limit); the ratio is printed once
# both runs' metrics are in ROOT. Nothing but the shape is set: the memory plan chooses
# the rest, as for any run. Settings (environment):
#   CONFIG    qwen3b_rkv
#   MODEL     a shape name for random weights, or an HF directory (qwen2.5-3b)
#   DATA      a prompt file (data/simplelr_qwen_level3to5.jsonl)
#   LEN       max_response_len (4096)
#   PROMPTS   prompts a rollout (32: 256 samples with qwen3b_rkv's 8 each, as on each of
#             the paper's 4 GPUs), in the config's optimizer steps a rollout
#   ROLLOUTS  rollouts each (2: the second shows the steady swaps)
#   ROOT      run folders and logs (/tmp/dense_vs_sparse)
#   LIMIT_S   seconds a run may take (0: no limit)
#   EXTRA     more train.py flags for both runs
#   RUNS      which runs to start now ("sparse dense"); the others' results are read from ROOT
#             (RUNS="" starts none: the tables and the ratio of the runs already in ROOT)
#   AT_ONCE   1: both at once where there are two GPUs (default); 0: one after the other
#   PORT      the compressed run's MASTER_PORT, the dense run's is PORT + 1 (29631): two
#             pairs on one machine need their own
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
CONFIG=${CONFIG:-qwen3b_rkv}; MODEL=${MODEL:-qwen2.5-3b}; LEN=${LEN:-4096}
PROMPTS=${PROMPTS:-32}; ROLLOUTS=${ROLLOUTS:-2}; ROOT=${ROOT:-/tmp/dense_vs_sparse}
DATA=${DATA:-data/simplelr_qwen_level3to5.jsonl}; LIMIT_S=${LIMIT_S:-0}
RUNS=${RUNS-sparse dense}; AT_ONCE=${AT_ONCE:-1}; PORT=${PORT:-29631}
for name in $RUNS; do
    case $name in sparse|dense) ;; *) echo "RUNS: '$name' is not sparse or dense" >&2; exit 2 ;; esac
done
case $AT_ONCE in 0|1) ;; *) echo "AT_ONCE: '$AT_ONCE' is not 0 or 1" >&2; exit 2 ;; esac
for name in $RUNS; do  # a port taken would fail the run with torchrun's traceback in its log
    port=$PORT; [ "$name" = dense ] && port=$((PORT + 1))
    python3 -m scripts.ports "$port" > /dev/null || {
        echo "PORT: $port (the $name run's) is in use, by another pair perhaps: set PORT" >&2
        exit 2; }
done
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
STEP_SAMPLES=$(python3 -c "from minisparse.config.load import load_config as l; c = l('$CONFIG')
print($PROMPTS * c.n_samples_per_prompt // c.num_steps_per_rollout)") || exit 2
mkdir -p "$ROOT"

# GPU i of the runs is the i-th of those this script may use: CUDA_VISIBLE_DEVICES as the
# caller set it (a queue pinned to GPU 3 stays on GPU 3), else every GPU.
VISIBLE_LIST=${CUDA_VISIBLE_DEVICES:-}
read -r -a VISIBLE <<< "${VISIBLE_LIST//,/ }"
run() {  # name gpu port [--set ...]: one train.py run into $ROOT/name
    local name=$1 gpu=$2 port=$3; shift 3
    [ "$GPUS" -gt 0 ] && export CUDA_VISIBLE_DEVICES=${VISIBLE[$gpu]:-$gpu}
    timeout -k 10 "$LIMIT_S" torchrun --nproc_per_node 1 --master_port "$port" train.py \
        --config "$CONFIG" --set model.path="$MODEL" --set data.path="$DATA" \
        --set max_response_len="$LEN" --set rollout_batch_size="$PROMPTS" \
        --set global_batch_size="$STEP_SAMPLES" --set num_rollout="$ROLLOUTS" \
        --set save_interval=0 --set log.tensorboard=false --set resume=never \
        --set output_dir="$ROOT/$name" ${EXTRA:-} "$@" > "$ROOT/$name.log" 2>&1
    echo "$name: exit $? (log $ROOT/$name.log)"
}
start() {  # name gpu: the compressed run, or the dense one (no old figures left behind)
    rm -f "$ROOT/$1/metrics.jsonl"
    case $1 in
        sparse) run sparse "$2" "$PORT" ;;
        dense) run dense "$2" $((PORT + 1)) --set compress.algorithm=none ;;
    esac
}
if [ "$GPUS" -ge 2 ] && [ "$AT_ONCE" = 1 ] && [ "$RUNS" = "sparse dense" ]; then
    start sparse 0 & start dense 1 & wait
else
    for name in $RUNS; do start "$name" 0; done
fi
for name in sparse dense; do
    echo "=== $name"
    [ -f "$ROOT/$name.log" ] || { echo "not run yet (RUNS=$name, same ROOT)"; continue; }
    grep -E "^  (rollout|chosen)|^rollout KV cache" "$ROOT/$name.log" | cut -c1-200
    [ -f "$ROOT/$name/metrics.jsonl" ] && python3 -m scripts.phase_table \
        "$ROOT/$name/metrics.jsonl" --prefix perf/ --key compress/peak_cache_tokens_mean | tail -30
done
python3 -m scripts.pair_table "$ROOT" --expect "$RUNS"; status=$?
# from 3 rollouts on, also each run's medians from rollout 2 (the first builds kernels)
if [ "$ROLLOUTS" -ge 3 ] && [ -f "$ROOT/sparse/metrics.jsonl" ] && [ -f "$ROOT/dense/metrics.jsonl" ]; then
    python3 -m scripts.pair_table "$ROOT" --rollouts "2-$ROLLOUTS" | tail -n 1
fi
exit $status
