#!/bin/bash
# Rollout engine speed on one GPU (issue 9), run from this checkout's root on the GPU machine:
#   STEPS=kernels   the fused-sampler GPU tests against the PyTorch reference
#   STEPS=quick     bench 256 x 1024 (dense, R-KV 512/128), this tree and BEFORE (if set);
#                   with 'ablate' also this tree with MINISPARSE_ENGINE_KERNELS=0
#   STEPS=profile   scripts/profile_engine.py, dense and R-KV, batch 256 (PROFILE_WARMUP
#                   decode steps first: 440 puts R-KV's first compression event inside
#                   the profiled window)
#   STEPS=exact     the engine's GPU exactness tests (tests/engine/test_gpu.py)
#   STEPS=full      bench 256 x 4096 dense and R-KV (REPEATS runs), this tree and BEFORE
#   STEPS=big       R-KV 512/128 with 1,024 sequences x NEW_BIG tokens
#   STEPS=serial    bench 256 x 4096 dense and R-KV once with --no-overlap (the ablation
#                   of overlapped decode steps)
#   STEPS=share     GRPO's shape: 128 prompts x 8 samples (SHARE_PROMPT tokens, SHARE_NEW
#                   new), SHARE_MODES (dense rkv), with and without prompt sharing
#                   (--no-share-prompt-cache), REPEATS runs each; sharing on in BEFORE too
# BEFORE: another checkout (the baseline) benched in the same command; logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/gpu_engine_speed}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-kernels,quick,profile}
PROFILE_MODES=${PROFILE_MODES:-dense rkv}
REPEATS=${REPEATS:-3}
NEW_BIG=${NEW_BIG:-4096}
PROFILE_WARMUP=${PROFILE_WARMUP:-256}
COMMON="--model qwen2.5-3b --device cuda --prompt-len 160 --warmup 32"
RKV="--compress rkv --budget 512 --divide-length 128"

bench() {  # name dir args...
    local name=$1 dir=$2; shift 2
    (cd "$dir" && timeout "${BENCH_S:-150}" python3 -m minisparse.engine.bench $COMMON "$@" --json "$LOGS/$name.json") \
        2>&1 | grep -v Warning | tee "$LOGS/$name.log" | grep "^\[\(bench\|phases\)"
}

if [[ $STEPS == *kernels* ]]; then  # compiled kernels; one process each (no interpreter)
    for t in test_gpu_kernels; do
        timeout 90 python3 -m pytest -q -x tests/engine/$t.py 2>&1 | tee "$LOGS/$t.log" | tail -3
    done
fi
if [[ $STEPS == *quick* ]]; then
    for mode in dense rkv; do
        extra=""; [[ $mode == rkv ]] && extra=$RKV
        bench "quick_${mode}_after" . --batch 256 --max-new 1024 --repeats 1 $extra
        [[ $STEPS == *ablate* ]] && MINISPARSE_ENGINE_KERNELS=0 bench "quick_${mode}_nokern" . \
            --batch 256 --max-new 1024 --repeats 1 $extra
        [[ -n ${BEFORE:-} ]] && bench "quick_${mode}_before" "$BEFORE" --batch 256 --max-new 1024 \
            --repeats 1 $extra
    done
fi
if [[ $STEPS == *profile* ]]; then
    for mode in $PROFILE_MODES; do
        extra=""; [[ $mode == rkv ]] && extra=$RKV
        timeout 80 python3 scripts/profile_engine.py $COMMON --batch 256 --max-new 1024 \
            --warmup "$PROFILE_WARMUP" --steps 32 --top 18 $extra 2>&1 | grep -v Warning | tee "$LOGS/profile_$mode.log" | tail -32
    done
fi
[[ $STEPS == *exact* ]] && timeout "${EXACT_S:-150}" python3 -m pytest -q tests/engine/test_gpu.py \
    2>&1 | tee "$LOGS/test_gpu.log" | tail -5
if [[ $STEPS == *full* ]]; then
    for mode in dense rkv; do
        extra=""; [[ $mode == rkv ]] && extra=$RKV
        bench "full_${mode}_after" . --batch 256 --max-new 4096 --repeats "$REPEATS" $extra
        [[ -n ${BEFORE:-} ]] && bench "full_${mode}_before" "$BEFORE" --batch 256 --max-new 4096 \
            --repeats "${BEFORE_REPEATS:-1}" $extra
    done
fi
if [[ $STEPS == *serial* ]]; then
    for mode in dense rkv; do
        extra=""; [[ $mode == rkv ]] && extra=$RKV
        bench "full_${mode}_serial" . --batch 256 --max-new 4096 --repeats 1 --no-overlap $extra
    done
fi
if [[ $STEPS == *share* ]]; then
    for mode in ${SHARE_MODES:-dense rkv}; do
        extra=""; [[ $mode == rkv ]] && extra=$RKV
        shape="--batch 128 --samples-per-prompt 8 --max-num-seqs 1024 --prompt-len
               ${SHARE_PROMPT:-256} --max-new ${SHARE_NEW:-1024} --repeats $REPEATS"
        bench "share_${mode}_on" . $shape $extra
        bench "share_${mode}_off" . $shape $extra --no-share-prompt-cache
        [[ -n ${BEFORE:-} ]] && bench "share_${mode}_on_before" "$BEFORE" $shape $extra
    done
fi
[[ $STEPS == *big* ]] && bench big_rkv_after . --batch 1024 --max-num-seqs 1024 \
    --max-new "$NEW_BIG" --repeats 1 $RKV
exit 0
