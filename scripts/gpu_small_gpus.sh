#!/bin/bash
# The paper's per-GPU step on one workstation-sized GPU: a paper config with the
# GPU capped at CAP GiB (gpu_memory_gb: the plan is made for CAP, and torch's per-process
# memory fraction makes any overshoot an out-of-memory error), 256 samples of up to 4,096
# new tokens (32 prompts x 8), two rollouts, random weights of the real shape; R-KV and/or
# its dense twin (compress.algorithm=none), one after the other on GPU 0
# (scripts/dense_vs_sparse.sh runs them). Then, per run: the plan's first line and table,
# planned against measured peaks per phase, phase and optimizer-step times, and the ratio.
#
#   CAP=24 CONFIG=qwen1.5b_rkv MODEL=qwen2.5-1.5b RUNS=sparse bash scripts/gpu_small_gpus.sh
#   CAP=24 CONFIG=qwen1.5b_rkv MODEL=qwen2.5-1.5b RUNS=dense bash scripts/gpu_small_gpus.sh
#   CAP=48 CONFIG=qwen3b_rkv MODEL=qwen2.5-3b RUNS=sparse bash scripts/gpu_small_gpus.sh
#   CAP=48 CONFIG=qwen3b_rkv MODEL=qwen2.5-3b RUNS=dense bash scripts/gpu_small_gpus.sh
#   # a CPU check of the script (seconds; planned for CAP, nothing capped):
#   CAP=1 CONFIG=tiny_rkv MODEL=tiny DATA=synthetic LEN=64 PROMPTS=2 ROLLOUTS=1 \
#       bash scripts/gpu_small_gpus.sh
#
# Settings (environment): CAP (GiB, 24), CONFIG (qwen1.5b_rkv), MODEL (a shape name for
# random weights, or an HF directory; qwen2.5-1.5b), RUNS ("sparse dense"), ROLLOUTS (2),
# LIMIT_S (seconds a run may take; 570), ROOT (/tmp/small_gpus/CONFIG_CAP; the same ROOT
# in a later call adds the other run and the ratio), HOST_GB (the host memory CPU Adam may
# count on; a VM whose RAM grows as it is used reads too little at start: 120), DATA, LEN,
# PROMPTS, EXTRA (as scripts/dense_vs_sparse.sh).
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
CAP=${CAP:-24}; CONFIG=${CONFIG:-qwen1.5b_rkv}; MODEL=${MODEL:-qwen2.5-1.5b}
export CONFIG MODEL ROLLOUTS=${ROLLOUTS:-2} LIMIT_S=${LIMIT_S:-570}
export ROOT=${ROOT:-/tmp/small_gpus/${CONFIG}_${CAP}} AT_ONCE=0
export MINISPARSE_HOST_MEMORY_GB=${HOST_GB:-120}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}  # CPU Adam's JIT build: Hopper only
export EXTRA="--set gpu_memory_gb=$CAP ${EXTRA:-}"
if ! python3 -c "import deepspeed" 2>/dev/null; then  # the carried wheels (.stage/deps)
    for part in .stage/deps/p*/; do bash "$part/install.sh" "$part"; done
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
bash scripts/dense_vs_sparse.sh
status=$?
python3 - "$ROOT" "$CAP" <<'PY'
import json, sys
from pathlib import Path

root, cap = Path(sys.argv[1]), sys.argv[2]
print(f"\n=== capped at {cap} GiB: planned against measured, per run and rollout")
for name in ("sparse", "dense"):
    log = root / f"{name}.log"
    if not log.exists():
        continue
    lines = log.read_text(errors="replace").splitlines()
    head = [l for l in lines if l.startswith("memory plan:") or l.startswith("error:")]
    oom = [l for l in lines if "OutOfMemoryError" in l or "out of memory" in l]
    print(f"--- {name}: {head[0] if head else '(no plan line)'}")
    if oom:
        print(f"    OUT OF MEMORY: {oom[-1][:200]}")
    metrics = root / name / "metrics.jsonl"
    rows = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.exists() else []
    print(f"    {'rollout':>7s} {'step_s':>7s} {'rollout_s':>9s} {'tok/s':>7s} {'preempt':>7s} "
          f"{'logp_s':>7s} {'update_s':>8s} {'opt_step_s':>10s}  peak GiB measured/planned "
          f"(rollout, logprobs, update)")
    for r in rows:
        peaks = ", ".join(f"{r.get(f'mem/{p}_peak_gib', float('nan')):.1f}/"
                          f"{r.get(f'memory_plan/{p}_gib', float('nan')):.1f}"
                          for p in ("rollout", "logprobs", "update"))
        g = lambda k: r.get(k, float("nan"))  # noqa: E731
        print(f"    {r['rollout']:7d} {g('time/step_s'):7.1f} {g('time/rollout_s'):9.1f} "
              f"{g('perf/rollout_tokens_per_s'):7.0f} {g('perf/preemptions'):7.0f} "
              f"{g('time/logprobs_s'):7.1f} {g('time/update_s'):8.1f} "
              f"{g('time/optimizer_step_s'):10.2f}  {peaks}")
PY
exit $status
