#!/usr/bin/env bash
# The planner's validation set of BENCHMARKS.md ("## plan"): every ranked candidate of the six
# sizes and the two-process pair measured for real, 30 rounds each. About 27 min on 2 idle cores;
# run nothing else meanwhile. Usage: tools/plan_validation.sh RUN_LETTER [OUT_DIR]
set -euo pipefail
S=${SPMDKIT:-spmdkit}
R=${1:-a}
OUT=${2:-.}
mkdir -p "$OUT"
run() {
  name=$1; shift
  "$S" plan --devices 8 --measure all --measure-rounds 30 "$@" --json "$OUT/${name}_$R.json" \
    > "$OUT/${name}_$R.txt" 2>&1
  echo "$name $(date +%T) $(uptime | sed 's/.*average//')" >> "$OUT/progress.log"
}
run six_lm264 --task lm --layers 2 --d-model 64 --heads 4 --seq-len 64 --batch-size 32
run six_mlp --task mlp
run six_mlp4 --task mlp --layers 4 --depth 1024 --embed 256 --batch-size 128
run six_mlp8 --task mlp --layers 8 --depth 1024 --embed 256 --batch-size 128
run six_lm464 --task lm --layers 4 --d-model 64 --heads 4 --seq-len 64 --batch-size 32
run six_lm4128 --task lm --layers 4 --d-model 128 --heads 8 --seq-len 128 --batch-size 32
run two_lm --task lm --layers 2 --d-model 64 --heads 4 --seq-len 64 --batch-size 32 --processes 2
run two_mlp --task mlp --processes 2
echo "finished $R" >> "$OUT/progress.log"
