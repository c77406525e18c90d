#!/bin/bash
# Training-phase performance on one GPU: the measured bf16 GEMM ceiling, the CUDA tests of
# the packed attention and fused LM head, then scripts/bench_train_phases.py (before/after
# variants of the log-prob and update phases, Qwen2.5-3B shape, random weights) and,
# unless SKIP_TRAIN=1, two rollouts of train.py with the new defaults. Logs go to
# $OUT (or /tmp/gpu_train_perf). DeepSpeed is installed from .stage/deps when missing.
#
#   bash scripts/gpu_train_perf.sh
set -uo pipefail
cd "$(dirname "$0")/.."
# always into our own target: a warm machine may hold other stagings' partial packages
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site_train_perf .stage/deps/p*/*.whl || exit 1
export PYTHONPATH=/tmp/site_train_perf${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__, deepspeed.__file__)" || exit 1
LOG=${OUT:-/tmp/gpu_train_perf}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
python3 - <<'PY'
import torch, triton.testing as tt
n = 8192
a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
ms = tt.do_bench(lambda: a @ b, warmup=200, rep=1000, return_mode="median")
print(f"bf16 GEMM {n}^3 (random data): {2 * n**3 / ms / 1e9:.0f} TFLOP/s (median {ms:.3f} ms)")
PY
python3 -m pytest -q -p no:cacheprovider tests/grpo/test_attention.py tests/grpo/test_fused_logprobs.py 2>&1 | tail -3
SHAPE=(--config qwen3b_rkv --set model.path=qwen2.5-3b --set data.path=synthetic
       --set rollout_batch_size=16 --set n_samples_per_prompt=8 --set global_batch_size=64
       --set num_steps_per_rollout=2 --set max_response_len=1024)
python3 scripts/bench_train_phases.py "${SHAPE[@]}" --samples 128 --response-len 1024 \
    --repeats 2 --json "$LOG/bench.json" "$@" 2>&1 | grep -v "^\[rank0\]:\[W\|UserWarning" | tee "$LOG/bench.log"
[ "${SKIP_TRAIN:-0}" = 1 ] && exit 0
rm -rf /tmp/gpu_train_perf_run
torchrun --standalone --nproc_per_node 1 train.py "${SHAPE[@]}" --set data.synthetic_size=256 \
    --set num_rollout=2 --set max_tokens_per_gpu=16384 --set model.gradient_checkpointing=true \
    --set save_interval=0 --set resume=never --set log.tensorboard=false \
    --set output_dir=/tmp/gpu_train_perf_run > "$LOG/train.log" 2>&1
tail -3 "$LOG/train.log"
cp /tmp/gpu_train_perf_run/metrics.jsonl "$LOG/" 2>/dev/null
python3 - /tmp/gpu_train_perf_run/metrics.jsonl <<'PY'
import json, sys
for row in (json.loads(line) for line in open(sys.argv[1])):
    print(f"--- train.py rollout {row['rollout']}")
    for p in [k[5:-2] for k in row if k.startswith("time/")]:
        print(f"{p:16s} {row['time/' + p + '_s']:8.2f} s  peak {row.get(f'mem/{p}_peak_gib', 0):6.2f} GiB")
    for k in sorted(k for k in row if k.startswith("perf/")) + ["train/micro_batches"]:
        print(f"{k:28s} {row.get(k, float('nan')):.4g}")
PY
