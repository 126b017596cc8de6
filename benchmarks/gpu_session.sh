#!/usr/bin/env bash
# The GPU machine's agenda in one `run` call (carry [".whl"], filled by scripts/gpu_wheels.sh):
#   source .whl/gpu-env.sh && bash benchmarks/gpu_session.sh
# Each part under its own time limit, its output in $OUT/<name>.log (megatron-core's import
# warnings filtered), so that one part failing or overrunning loses nothing of the others.
# Together at most ~9.5 minutes, the limit of one call (the GPU tier took 162 s on 2026-11-24). What each part answers is in issue 26
# and benchmarks/RESULTS.md; the last H100 results are in benchmarks/results/h100-2026-11-24/.
set -uo pipefail
OUT="${OUT:-benchmarks/results/gpu-$(date -u +%Y-%m-%d)}"
mkdir -p "$OUT"
part() {  # part NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  echo "== $name ($*), up to ${seconds}s"
  timeout "$seconds" "$@" 2>&1 | grep -v -e "UserWarning: Transformer Engine" -e "^  warnings.warn" > "$OUT/$name.log"
  echo "   exit ${PIPESTATUS[0]}; $(tail -n 1 "$OUT/$name.log")"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/device.txt"
date -u >> "$OUT/device.txt"
# stapo-doctor first: one row per GPU component (versions, NCCL, the op, attention, TE spec, the
# vLLM engine and the mismatch), rows for what this machine lacks (TE, vLLM, a second GPU) skipped
# with the reason; its two STAPO steps are left to the GPU tier's trainer test, for the time limit
part doctor 60 python3 -m stapo_megatron.doctor.cli --skip stapo_steps
# the GPU tier: SDPA/varlen packed attention on CUDA bf16, the CP chunk attention, the op, a
# policy update CUDA vs CPU, the trainer on CUDA with the HF engine, router replay (MoE) CUDA vs CPU
part pytest_gpu 180 python3 -m pytest -q -m gpu tests
# the local-spec CP attention kernel: one rank's chunks vs the whole sequence (one GPU: no all-gather)
part bench_context_parallel_cuda 60 python3 benchmarks/bench_context_parallel.py --device cuda --tokens 32768
# the no-grad forward's block/warps at the size that matters (the 2026-11-24 sweep was at N=4096)
part bench_logprob_entropy_tune_16k 120 python3 benchmarks/bench_logprob_entropy.py --device cuda --tune --tokens 16384
# the paper recipes' new assumption: no recomputation (the 8B/14B recipes drop it with CP)
part bench_gpu_step_no_recompute 150 python3 benchmarks/bench_gpu_step.py --models qwen3-1.7b --seq-lens 4096 8192 --recompute none --rounds 2
ls -l "$OUT"
