#!/usr/bin/env bash
# The GPU machine's agenda in ONE device call (carry [".whl"], filled by scripts/gpu_wheels.sh):
#   source .whl/gpu-env.sh && bash benchmarks/gpu_session.sh
#   bash benchmarks/gpu_session.sh --only pytest_gpu_trainer,doctor   # a later call: what the first skipped
#   bash benchmarks/gpu_session.sh --smoke     # the same parts on the CPU at tiny sizes (a code check)
#   bash benchmarks/gpu_session.sh --plan --deadline 300   # which parts a deadline admits (nothing runs)
# Parts run one after another, in the order below, against ONE deadline (--deadline, seconds from
# the script's start; default 570: the call's 600 s less ~15 s for gpu-env.sh and a margin). A
# part starts only if its budget fits in the time left; one that does not is logged SKIPPED and
# the next is tried, so no part is cut at the deadline mid-way. A part that starts is killed at
# twice its budget or at the deadline, whichever is first (logged as cut). Every line of every
# part's log carries the seconds since the session started; session.log has each part's start,
# end, exit and time; skipped.txt the parts to run in a later call (--only, comma-separated).
# pytest prints each test's duration as it ends (console_output_style=times), then every
# duration (--durations=0), and writes a JUnit XML with each test's time. The GPU tier is three
# parts: what is quick, the trainer test and router replay.
#
# Order: what was never measured first (the packed 16k row and what a SwiGLU keeps), then the GPU
# tier's three parts together (the quick tests, among them the op's kernels on CUDA before they
# are timed; the trainer test, S2T on CUDA against the CPU; router replay), the op's timing, the
# doctor, the 16k row measured before. Admission uses the time really left, so budgets larger
# than the parts' times cost only near the end.
# Budgets (seconds) from the committed logs; "unmeasured" where no log has the part's time:
#   bench_gpu_step_packed_16k  120  unmeasured: cut at its 45 s limit before its first row
#                                   (results/h200-2026-11-27-fixes/bench_gpu_step_packed_16k.log)
#   saved_bytes                 60  unmeasured: the RMSNorm row, then cut at its 20 s limit
#                                   (results/h200-2026-11-27-fixes/saved_bytes.log)
#   pytest_gpu_quick           220  63 s of measured calls (results/h200-2026-11-27/pytest_gpu2.log:
#                                   the CUDA op 3.7 + 0.6, packed/CP attention 20.7 + 18.7, TP=2
#                                   kernels 8.6 + 7.6, the Triton path's 17 tests 3.3); unmeasured:
#                                   the policy update, SDPA x 2, convert-verify, the lane test and
#                                   the collection of the whole tree (25 s each, 30)
#   pytest_gpu_trainer         200  the CUDA launches 44.6 + 31.8 s (results/h200-2026-11-27-fixes/
#                                   followup/trainer.log); the CPU launch of 3 steps 94 s on a
#                                   2-core CPU (results/cpu-2026-11-29/trainer_cpu_3steps.log),
#                                   unmeasured on a GPU machine; the test's own limit is 300 s
#   pytest_gpu_router           70  51.8 s (results/h200-2026-11-27/pytest_gpu2.log), 43.3 s
#                                   (results/h200-2026-11-27-fixes/followup/router_replay.log)
#   bench_logprob_entropy_16k  150  unmeasured (no log holds the part's time; 9 sweep shapes x 2 forwards)
#   doctor                      45  its rows 14.4 s (results/h200-2026-11-27-fixes/doctor.log);
#                                   the imports unmeasured (the trainer's: 10-14 s)
#   bench_gpu_step_no_recompute 60  one row: the update 2.7 s x 2 rounds (results/h200-2026-11-27-
#                                   fixes/bench_gpu_step_no_recompute.log); the process unmeasured
# Sum 925 s: one call of 570 s runs what fits in order and skips the rest (skipped.txt).
set -uo pipefail
SMOKE=0 PLAN=0 ONLY="" DEADLINE=570
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --plan) PLAN=1 ;;
    --only) ONLY="$2"; shift ;;
    --deadline) DEADLINE="$2"; shift ;;
    *) echo "gpu_session.sh: unknown argument $1 (--smoke, --plan, --only NAMES, --deadline SECONDS)" >&2; exit 2 ;;
  esac
  shift
done
OUT="${OUT:-benchmarks/results/gpu-$(date -u +%Y-%m-%d)}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1  # lines reach the log (and their time stamp) when printed
SCALE=$((SMOKE ? 4 : 1))  # the CPU is slower: in the smoke run budgets and deadline are 4 x
DEADLINE=$((DEADLINE * SCALE))
T0=$EPOCHSECONDS
ELAPSED=0  # --plan: the parts admitted so far, each taken to last its budget
elapsed() { if [ "$PLAN" = 1 ]; then echo "$ELAPSED"; else echo $((EPOCHSECONDS - T0)); fi; }
say() { printf '%5ds %s\n' "$(elapsed)" "$*" | tee -a "$OUT/session.log"; }
stamp() { while IFS= read -r line; do printf '%5ds %s\n' $((EPOCHSECONDS - T0)) "$line"; done; }
quiet() {  # megatron-core's import warnings and vLLM's LRU note, which say nothing about the run
  grep --line-buffered -v -e "UserWarning: Transformer Engine" -e "^  warnings.warn" \
    -e "SyntaxWarning: invalid escape" -e "Evict LRU cached blocks" -e "Apex is not installed"
}
: > "$OUT/skipped.txt"
part() {  # part NAME BUDGET COMMAND...
  local name=$1 budget=$(($2 * SCALE)); shift 2
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",$name,"* ]]; then return; fi
  local start left
  start=$(elapsed); left=$((DEADLINE - start))
  if [ "$budget" -gt "$left" ]; then
    say "SKIPPED $name: budget ${budget}s, ${left}s left before the deadline (${DEADLINE}s)"
    echo "$name" >> "$OUT/skipped.txt"
    return
  fi
  local limit=$((2 * budget < left ? 2 * budget : left))
  say "START $name: budget ${budget}s, cut at ${limit}s, ${left}s left: $*"
  if [ "$PLAN" = 1 ]; then ELAPSED=$((ELAPSED + budget)); return; fi
  timeout -k 5 "$limit" "$@" 2>&1 | quiet | stamp > "$OUT/$name.log"
  local code=${PIPESTATUS[0]} took=$(($(elapsed) - start))
  [ "$code" = 124 ] || [ "$code" = 137 ] && code="$code (cut at ${limit}s)"
  say "END $name: exit $code after ${took}s (budget ${budget}s); last line: $(tail -n 1 "$OUT/$name.log" | cut -c8-)"
}
pytest_part() {  # pytest_part NAME BUDGET PYTEST-ARGS...: per-test durations as they end, then all
  local name=$1 budget=$2; shift 2
  part "$name" "$budget" "$PY" -m pytest -v -o console_output_style=times --durations=0 -p no:cacheprovider \
    "${TIMEOUT[@]}" --junitxml="$OUT/$name.xml" "$@"
}
TIMEOUT=(--timeout 120)  # per GPU test (pytest-timeout; a test's `timeout` mark overrides it)
QUICK=(-k "not router_replay and not test_cuda_steps_checkpoint_and_resume_equal_the_cpu")
if [ "$SMOKE" = 1 ]; then
  # --tiny: the tiny Qwen3 at 64 and 128 tokens whatever --seq-lens says
  DEV=(--device cpu); STEP=(--device cpu --tiny --rounds 1 --warmup 0); OP=(--device cpu --smoke)
  "$PY" -c "import pytest_timeout" 2>/dev/null || TIMEOUT=()  # pytest-timeout: on the GPU machine
  [ "$PLAN" = 1 ] || echo "smoke run on the CPU: $(date -u)" > "$OUT/device.txt"
else
  DEV=(--device cuda); STEP=(--models qwen3-1.7b --recompute none --rounds 2); OP=(--device cuda --tune --tokens 16384)
  if [ "$PLAN" = 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/device.txt"
    date -u >> "$OUT/device.txt"
  fi
fi
say "session: deadline ${DEADLINE}s${ONLY:+, only $ONLY}$([ "$SMOKE" = 1 ] && echo ', smoke run on the CPU')"
# 1. Qwen3-1.7B update at a 16k-token budget with budget packing (the paper's lengths,
# bench_packing.py's draw), no recomputation: never measured
part bench_gpu_step_packed_16k 120 "$PY" benchmarks/bench_gpu_step.py "${STEP[@]}" --seq-lens 16384 --packing budget
# 2. what a layer's RMSNorm and SwiGLU keep for the backward beyond their input (the memory
# model: 0 bytes per token and hidden unit beyond the input for both on CUDA): SwiGLU never measured
part saved_bytes 60 "$PY" benchmarks/saved_bytes.py "${DEV[@]}"
# 3. the GPU tier but its two long tests: the op's kernels, attention, conversion, the policy update
pytest_part pytest_gpu_quick 220 -m gpu tests "${QUICK[@]}"
# 4. the trainer on CUDA (2 steps, checkpoint, resume to 3) with S2T at work, against the CPU
pytest_part pytest_gpu_trainer 200 -s -m gpu tests/gpu/test_trainer_s2t.py
# 5. router replay (MoE) with full recomputation on CUDA against the CPU
pytest_part pytest_gpu_router 70 -s -m gpu tests/gpu/test_gpu.py -k router_replay
# 6. the op at N = 16,384 against the HBM bound and its block/warps sweep
part bench_logprob_entropy_16k 150 "$PY" benchmarks/bench_logprob_entropy.py "${OP[@]}"
# 7. stapo-doctor: one row per GPU component (its first line names the device); its two STAPO
# steps are left to the trainer test (the same code path)
part doctor 45 "$PY" -m stapo_megatron.doctor.cli --skip stapo_steps
# 8. Qwen3-1.7B update without recomputation, one sequence of 16k tokens per micro-batch
part bench_gpu_step_no_recompute 60 "$PY" benchmarks/bench_gpu_step.py "${STEP[@]}" --seq-lens 16384
say "session: $(elapsed)s; skipped: $(paste -sd, "$OUT/skipped.txt")"
[ "$PLAN" = 1 ] || ls -l "$OUT"
