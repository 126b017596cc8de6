#!/usr/bin/env bash
# The GPU machine's agenda in ONE device call (carry [".whl"], filled by scripts/gpu_wheels.sh):
#   source .whl/gpu-env.sh && bash benchmarks/gpu_session.sh
#   bash benchmarks/gpu_session.sh --smoke     # the same parts on the CPU at tiny sizes (a code check)
# Parts run one after another (the GPU tier never beside the doctor: beside it, on the H200 of
# 2026-11-27, both slowed down and the tier was cut), each under its own time limit, its output in
# $OUT/<name>.log (megatron-core's import warnings filtered), so that one part failing or
# overrunning loses nothing of the others; every GPU test has its own pytest-timeout.
# Budgets (seconds; the call's limit is 600, the cold start is counted apart):
#     doctor 40 (its rows took 13 s on the H200, plus imports) + GPU tier 270 (the H200 of 2026-11-27:
#     ~120 s for the 25 tests that finished alone, ~85 s estimated for the rest, the trainer test
#     cut to ~40 s) + saved bytes of a norm and a SwiGLU 20 + op at N=16384 with the sweep 60
#   + Qwen3-1.7B one sequence of 8k and 16k tokens, no recomputation 100 (two fresh processes,
#     3 x 2 updates each: 1.2 s and 2.7 s on the H200) + the same at a 16k budget packed 45
#   = 535 s <= 540 s: 9 minutes, 65 s short of the call's 600 s limit.
# The last results: benchmarks/results/h200-2026-11-27/ and h100-2026-11-24/ (benchmarks/RESULTS.md).
set -uo pipefail
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT="${OUT:-benchmarks/results/gpu-$(date -u +%Y-%m-%d)}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
TIMEOUT=(--timeout 120)  # per GPU test (pytest-timeout); the slowest measured: router replay 52 s on the H200
SCALE=$((SMOKE ? 4 : 1))  # the CPU is slower: the smoke run's parts get 4 x the time
part() {  # part NAME SECONDS COMMAND...
  local name=$1 seconds=$(($2 * SCALE)) start=$SECONDS; shift 2
  echo "== $name ($*), up to ${seconds}s"
  timeout -k 5 "$seconds" "$@" 2>&1 | grep -v -e "UserWarning: Transformer Engine" -e "^  warnings.warn" \
    -e "SyntaxWarning: invalid escape" -e "Evict LRU cached blocks" > "$OUT/$name.log"
  echo "   exit ${PIPESTATUS[0]} after $((SECONDS - start))s; $(tail -n 1 "$OUT/$name.log")"
}
if [ "$SMOKE" = 1 ]; then
  echo "smoke run on the CPU: $(date -u)" > "$OUT/device.txt"
  DEV=(--device cpu); STEP=(--device cpu --tiny --rounds 1 --warmup 0); OP=(--device cpu --smoke)
  TIER=(-m gpu tests/gpu)  # collected and skipped without CUDA: the imports and markers are checked
  "$PY" -c "import pytest_timeout" 2>/dev/null || TIMEOUT=()  # pytest-timeout: on the GPU machine
else
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/device.txt"
  date -u >> "$OUT/device.txt"
  DEV=(--device cuda); STEP=(--models qwen3-1.7b --recompute none --rounds 2); OP=(--device cuda --tune --tokens 16384)
  TIER=(-m gpu tests)
fi
# 1. stapo-doctor: one row per GPU component (versions, NCCL, the op, attention, TE spec, the vLLM
# engine and the mismatch), rows for what this machine lacks skipped with the reason; its two STAPO
# steps are left to the tier's trainer test (same code path, 53 s on the H200)
part doctor 40 "$PY" -m stapo_megatron.doctor.cli --skip stapo_steps
# 2. the GPU tier alone, each test under its own time limit (TIMEOUT)
part pytest_gpu 270 "$PY" -m pytest -v "${TIMEOUT[@]}" --durations=0 -p no:cacheprovider "${TIER[@]}"
# 3. what a layer's RMSNorm and SwiGLU keep for the backward here beyond their input (the memory
# model: 8 bytes per token and hidden unit for the norm's fp32 copies, 0 for the fused SwiGLU)
part saved_bytes 20 "$PY" benchmarks/saved_bytes.py "${DEV[@]}"
# 4. the op at N = 16,384 against the HBM bound and its block/warps sweep
part bench_logprob_entropy_16k 60 "$PY" benchmarks/bench_logprob_entropy.py "${OP[@]}"
# 5. Qwen3-1.7B update without recomputation: one sequence of 8k and 16k tokens per micro-batch
part bench_gpu_step_no_recompute 100 "$PY" benchmarks/bench_gpu_step.py "${STEP[@]}" --seq-lens 8192 16384
# 6. the same at a 16k-token budget with budget packing (the paper's lengths, bench_packing.py's draw)
part bench_gpu_step_packed_16k 45 "$PY" benchmarks/bench_gpu_step.py "${STEP[@]}" --seq-lens 16384 --packing budget
echo "session: ${SECONDS}s"
ls -l "$OUT"
