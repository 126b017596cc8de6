# second, short device call: the two GPU tests the first call's tier did not reach, with live output
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 examples/prepare_tiny_model.py /tmp/tm > "$OUT/prepare.log" 2>&1
export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29517
trainer() {  # trainer STEPS SECONDS
  local t0=$SECONDS
  timeout "$2" python3 -u tests/helpers/hf_engine_trainer_script.py /tmp/run /tmp/tm "$1" 2>&1 \
    | grep --line-buffered -v -e "UserWarning" -e "warnings.warn" \
    | while IFS= read -r l; do echo "$1 $((SECONDS - t0)) $l" >> "$OUT/trainer.log"; done
  echo "trainer $1 steps: $((SECONDS - t0)) s"; tail -2 "$OUT/trainer.log"
}
trainer 2 90
timeout 85 python3 -m pytest -v -s --timeout 80 -p no:cacheprovider tests/gpu/test_gpu.py -k router_replay \
  > "$OUT/router_replay.log" 2>&1; echo "router exit $?"; grep -E "PASS|FAIL|Error|assert" "$OUT/router_replay.log" | tail -5
trainer 3 70
