#!/usr/bin/env bash
# Where a decode step of the 1.5B goes, and the bench at batch 16, 64 and 256, on one GPU:
#   bash scripts/gpu_decode_profile.sh OUTDIR [MODEL]
# MODEL: a converted checkpoint folder or a shape name (default qwen2.5-1.5b, random weights;
# decode speed does not depend on the values).
set -uo pipefail
out=${1:?OUTDIR}; model=${2:-qwen2.5-1.5b}
mkdir -p "$out"; export PYTHONUNBUFFERED=1
prof="python -m minisparse.bench.profile --model $model --batch 16,64,256 --cache-len 768"
$prof --json "$out/prof_dense.json" > "$out/prof_dense.txt" 2>&1
$prof --no-fused-kernels --json "$out/prof_dense_reference.json" > "$out/prof_dense_reference.txt" 2>&1
$prof --compress rkv --budget 192 --divide-length 32 --json "$out/prof_rkv.json" > "$out/prof_rkv.txt" 2>&1
bench="python -m minisparse.bench --model $model --device cuda --prompt-len 256 --max-new-tokens 1024 --repeats 3"
for b in 16 64 256; do
  $bench --batch $b --json "$out/bench_dense_$b.json" 2>&1 | grep '^\[bench' >> "$out/bench.txt"
  $bench --batch $b --compress rkv --json "$out/bench_rkv_$b.json" 2>&1 | grep '^\[bench' >> "$out/bench.txt"
done
