#!/usr/bin/env bash
# The GPU machine's agenda in ONE device call (carry [".whl"], filled by scripts/gpu_wheels.sh):
#   source .whl/gpu-env.sh && bash benchmarks/gpu_session.sh
#   bash benchmarks/gpu_session.sh --smoke     # the same parts on the CPU at tiny sizes (a code check)
# Parts run one after another (the GPU tier never beside the doctor: beside it, on the H200 of
# 2026-11-27, both slowed down and the tier was cut), each under its own time limit, its output in
# $OUT/<name>.log (megatron-core's import warnings filtered), so that one part failing or
# overrunning loses nothing of the others; every GPU test has its own pytest-timeout.
# Budgets (seconds; the call's limit is 600, the cold start is counted apart; the times measured on
# the H200 of 2026-11-27, benchmarks/results/h200-2026-11-27-fixes/):
#     doctor 45 (33 s) + GPU tier 330 (the 25 quick tests ~120 s, router replay 45 s, the trainer
#     test's two launches 77 s, collection ~20 s) + op at N=16384 with the sweep 50 (35 s)
#   + Qwen3-1.7B one sequence of 16k tokens, no recomputation 55 (one process: ~43 s)
#   + the same at a 16k budget packed 60 = 540 s; then what a norm and a SwiGLU keep 30, last, so
#   that a cut at the call's limit loses only it (570 s, plus ~15 s for gpu-env.sh).
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
part doctor 45 "$PY" -m stapo_megatron.doctor.cli --skip stapo_steps
# 2. the GPU tier alone, each test under its own time limit (TIMEOUT)
part pytest_gpu 330 "$PY" -m pytest -v "${TIMEOUT[@]}" --durations=0 -p no:cacheprovider "${TIER[@]}"
# 3. the op at N = 16,384 against the HBM bound and its block/warps sweep
part bench_logprob_entropy_16k 50 "$PY" benchmarks/bench_logprob_entropy.py "${OP[@]}"
# 4. Qwen3-1.7B update without recomputation: one sequence of 16k tokens per micro-batch (the 8k
# row: benchmarks/results/h200-2026-11-27-fixes/)
part bench_gpu_step_no_recompute 55 "$PY" benchmarks/bench_gpu_step.py "${STEP[@]}" --seq-lens 16384
# 5. the same at a 16k-token budget with budget packing (the paper's lengths, bench_packing.py's draw)
part bench_gpu_step_packed_16k 60 "$PY" benchmarks/bench_gpu_step.py "${STEP[@]}" --seq-lens 16384 --packing budget
# 6. what a layer's RMSNorm and SwiGLU keep for the backward here beyond their input (the memory
# model: 0 bytes per token and hidden unit beyond the input for both on CUDA)
part saved_bytes 30 "$PY" benchmarks/saved_bytes.py "${DEV[@]}"
echo "session: ${SECONDS}s"
ls -l "$OUT"
