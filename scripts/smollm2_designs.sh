#!/bin/bash
# Where does compression act through a whole run? Each design (a name, a variant of
# scripts/ablation.sh and train.py overrides) trains SmolLM2-135M-Instruct for
# ROLLOUTS rollouts, every design at once on the machine's GPUs, one seed each; then a
# table per 10-rollout window of what decides whether a design can test the Sparse-RL
# corrections: the share of response tokens sampled from a compressed cache
# (compress/compressed_token_frac), the mismatch KL, training accuracy and response length
# (python -m minisparse.plot --table), and held-out accuracy at the last rollout.
# The naive run (rkv_naive: every correction off) is the probe: it is the variant most
# free to learn its way out of compression (shorter answers), as it did on the shipped
# task's first design (docs/results.md).
#
#   bash scripts/smollm2_designs.sh                 # the designs measured in docs/results.md
#   DESIGNS_FILE=my_designs.txt bash scripts/smollm2_designs.sh
#
# A designs file holds one design a line, "NAME VARIANT OVERRIDES...", e.g.
#   b32 rkv_naive --set compress.budget=32 --set compress.divide_length=8
# Options (environment; default in brackets): ROLLOUTS [40], TRAIN_S (seconds each run
# trains in this command) [420], ROOT [outputs/designs], PORT [29700], KV_GB [1],
# BASE (the model) [checkpoints/smollm2-135m-instruct], DESIGNS_FILE [the list below],
# EXTRA (overrides for every design, before its own).
case ${1:-} in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -uo pipefail
cd "$(dirname "$0")/.."
ROLLOUTS=${ROLLOUTS:-40}
TRAIN_S=${TRAIN_S:-420}
ROOT=${ROOT:-outputs/designs}
PORT=${PORT:-29700}
DEFAULT_DESIGNS='
dense dense
kp16 rkv_naive --set compress.keep_prompt=true --set compress.budget=16 --set compress.divide_length=8
b24 rkv_naive --set compress.budget=24 --set compress.divide_length=8
b32 rkv_naive --set compress.budget=32 --set compress.divide_length=8
b48 rkv_naive --set compress.budget=48 --set compress.divide_length=8
dense_2op dense --set data.synthetic_operations=2
kp16_2op rkv_naive --set data.synthetic_operations=2 --set compress.keep_prompt=true --set compress.budget=16 --set compress.divide_length=8
b32_2op rkv_naive --set data.synthetic_operations=2 --set compress.budget=32 --set compress.divide_length=8
'
if [ -n "${DESIGNS_FILE:-}" ]; then
    [ -f "$DESIGNS_FILE" ] || { echo "smollm2_designs.sh: no file $DESIGNS_FILE" >&2; exit 2; }
    DESIGNS=$(cat "$DESIGNS_FILE")
else
    DESIGNS=$DEFAULT_DESIGNS
fi
N=$(grep -c '[^[:space:]]' <<< "$DESIGNS")
# the runs share the machine's cores rather than each taking them all
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / N > 0 ? $(nproc) / N : 1 ))}
mkdir -p "$ROOT"
i=0
runs=() names=()
while read -r name variant overrides; do
    [ -n "$name" ] || continue
    ROOT="$ROOT/$name" SEEDS=1 VARIANTS="$variant" ROLLOUTS=$ROLLOUTS EVAL_EVERY=$ROLLOUTS \
        TRAIN_S=$TRAIN_S GRACE_S=60 PORT=$((PORT + i)) EXTRA="${EXTRA:-} $overrides" \
        bash scripts/ablation.sh > "$ROOT/$name.log" 2>&1 &
    runs+=("$ROOT/$name/${variant}_seed1") names+=("$name")
    i=$((i + 1))
done <<< "$DESIGNS"
wait
have=() have_names=()
for k in "${!runs[@]}"; do
    [ -f "${runs[$k]}/metrics.jsonl" ] && have+=("${runs[$k]}") have_names+=("${names[$k]}")
done
[ ${#have[@]} -gt 0 ] || { echo "smollm2_designs.sh: no design logged a rollout" >&2; exit 1; }
python -m minisparse.plot "${have[@]}" --names "$(IFS=,; echo "${have_names[*]}")" --group \
    --table | tee "$ROOT/designs.md"
