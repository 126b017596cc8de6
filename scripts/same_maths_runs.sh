#!/bin/bash
# The fixed-seed short runs of the "same maths" check: run them with two checkouts, then
# compare with scripts/compare_metrics.py (and diff the demo_synthetic tables, its "sec" column aside).
#   scripts/same_maths_runs.sh ROOT OUT     # ROOT: a checkout (used as PYTHONPATH); OUT: a new folder
# Writes OUT/{padded,budget,fixed,moe,moe_replay}/metrics.jsonl and OUT/synthetic.log; each run's
# log beside it and its exit code in OUT/done. About 15 minutes on 2 CPU cores.
set -u
ROOT=$(cd "$1" && pwd); OUT=$2; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
PY_BIN=${PY_BIN:-$ROOT/.venv/bin}  # the venv with torchrun (PY_BIN=... to use another)
cd "$ROOT"
export PYTHONPATH=$ROOT
TR="$PY_BIN/torchrun --nproc-per-node 2"
EVAL_EVERY=${EVAL_EVERY:-eval.every}  # EVAL_EVERY=eval_every for a checkout from before the eval section
COMMON="steps=2 $EVAL_EVERY=2 save_every=0 warmstart.steps=20 seed=7"
run() { name=$1; shift; $TR "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?" >> "$OUT/done"; }
run padded examples/demo_rl.py $COMMON packing=padded output_dir=$OUT/padded
run budget examples/demo_rl.py $COMMON packing=budget output_dir=$OUT/budget
run fixed examples/demo_rl.py $COMMON packing=fixed output_dir=$OUT/fixed
run moe examples/demo_rl.py recipe=tiny_moe $COMMON output_dir=$OUT/moe
run moe_replay examples/demo_rl.py recipe=tiny_moe $COMMON rollout.routing_replay=True output_dir=$OUT/moe_replay
run synthetic examples/demo_synthetic.py
