"""Benchmark: one STAPO policy update (forward, backward, optimizer step) of Qwen3 shapes on a GPU.

Qwen3-0.6B and Qwen3-1.7B architectures (their HF configs, written inline; random weights), bf16,
Megatron-Core's local spec with the SDPA core attention (no transformer-engine / apex), TP=1,
one sequence of 4k / 8k / 16k tokens per micro-batch, the recipe's full recomputation (uniform,
1 layer; `--recompute none` keeps every activation, `selective` recomputes the core attention).
Every (model, length) runs in a fresh process, so no memory of an earlier configuration counts
toward a later one's peak (Megatron's global buffers outlive `del model`: in one process, on the
H100, each configuration's peak included every earlier model's weights and optimizer state).
Per shape and length it prints:

- time of one update (median over rounds; STAPO and JustRL interleaved on the same data),
- achieved model TFLOP/s: 6 x (matmul parameters + output layer) x tokens + causal attention
  (3 x 2 x s x q_size per token and layer), recomputation not counted (the usual MFU convention),
- the bf16 matmul rate measured in the same run (a large torch.matmul) and the ratio,
- peak memory (torch.cuda.max_memory_allocated / reserved) beside the recipe's per-GPU memory
  estimate (`stapo_megatron.recipes.memory.memory_estimate`, training part, for this layout),
- the STAPO / JustRL time ratio (median of per-round ratios).

    source .whl/gpu-env.sh && python3 benchmarks/bench_gpu_step.py            # the H100 run
    .venv/bin/python benchmarks/bench_gpu_step.py --device cpu --tiny          # a CPU smoke run
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

import torch

QWEN3_CONFIGS = {
    # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json (architecture fields)
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False, hidden_act="silu"),
    # https://huggingface.co/Qwen/Qwen3-1.7B/blob/main/config.json
    "qwen3-1.7b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False, hidden_act="silu"),
}
GB = 1e9


def model_flops(spec, tokens: int, seq_len: int) -> float:
    """Forward + backward FLOPs of `tokens` tokens in sequences of `seq_len` (no recompute)."""
    h, q, kv, ffn = spec.hidden_size, spec.q_size, spec.kv_size, spec.ffn_hidden_size
    layer_matmul = h * (q + 2 * kv) + q * h + 3 * h * ffn
    dense = spec.num_layers * layer_matmul + h * spec.vocab_size
    attention = spec.num_layers * 2 * seq_len * q  # QK^T and PV over the causal half, forward
    return 3 * (2 * dense + attention) * tokens


def matmul_rate(device, size: int, dtype) -> float:
    """TFLOP/s of a size^3 torch.matmul (median of 10 after warm-up)."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(13):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 2 * size**3 / statistics.median(times) / 1e12


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def microbatches(spec, seq_len: int, num_microbatches: int, seed: int):
    """One sequence of seq_len tokens per micro-batch: an 1/8 prompt, the rest response."""
    from stapo_megatron.recipes.synthetic import synthetic_rollouts

    prompt = seq_len // 8
    mbs, _ = synthetic_rollouts(1, num_microbatches, prompt, seq_len - prompt, spec.vocab_size, seed=seed,
                                micro_batch_size=1)
    return mbs


def bench_one(name, hf_config, seq_len, args, device, dtype, rate):
    from stapo_megatron.bridge import build_gpt_model, spec_from_hf_config
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.parallel import current_groups
    from stapo_megatron.mcore.config import ModelConfig
    from stapo_megatron.recipes.memory import ParallelLayout, memory_estimate
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer

    spec = spec_from_hf_config(hf_config)
    groups = current_groups()
    recompute = {"full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                 "selective": dict(recompute_granularity="selective"), "none": {}}[args.recompute]
    model = build_gpt_model(hf_config, params_dtype=dtype, bf16=dtype == torch.bfloat16, calculate_per_token_loss=True,
                            **recompute)
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-6))
    mbs = microbatches(spec, seq_len, args.num_microbatches, seed=0)
    ctx = PassContext(model, seq_len, groups=groups, vocab_size=spec.vocab_size)
    old_policy_pass(ctx, [mbs])
    methods = {"stapo": LossConfig(method="stapo"), "justrl": LossConfig(method="justrl")}
    times = {m: [] for m in methods}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for r in range(args.warmup + args.rounds):
        for method, loss_config in methods.items():
            _sync(device)
            t0 = time.perf_counter()
            policy_update(ctx, optimizer, mbs, loss_config)
            _sync(device)
            if r >= args.warmup:
                times[method].append(time.perf_counter() - t0)
    t = statistics.median(times["stapo"])
    ratio = statistics.median(a / b for a, b in zip(times["stapo"], times["justrl"]))
    tflops = model_flops(spec, seq_len * args.num_microbatches, seq_len) / t / 1e12
    # the memory model of every recompute mode ("selective" is counted as none there)
    layout = ParallelLayout(num_nodes=1, gpus_per_node=1, vllm_tensor_parallel_size=1,
                            vllm_gpu_memory_utilization=0.0, model=ModelConfig(**recompute))
    estimate = memory_estimate(spec, layout, seq_len=seq_len)
    peak = torch.cuda.max_memory_allocated() / GB if device.type == "cuda" else float("nan")
    reserved = torch.cuda.max_memory_reserved() / GB if device.type == "cuda" else float("nan")
    print(f"{name:>11} {seq_len:>6} {t * 1e3:>9.1f} {tflops:>8.3g} {tflops / rate:>7.1%} {peak:>8.1f} {reserved:>8.1f} "
          f"{_gb(estimate and estimate.training):>8} {_gb(estimate and estimate.training - estimate.overhead):>8} "
          f"{ratio:>7.3f}", flush=True)


def _gb(value) -> str:
    return "-" if value is None else f"{value / GB:.1f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen3 test model at 64/128 tokens (CPU smoke run)")
    p.add_argument("--models", nargs="+", default=list(QWEN3_CONFIGS))
    p.add_argument("--seq-lens", nargs="+", type=int, default=[4096, 8192, 16384])
    p.add_argument("--num-microbatches", type=int, default=4, help="micro-batches (sequences) per update")
    p.add_argument("--recompute", choices=["full", "selective", "none"], default="full",
                   help="activation recomputation (the paper recipes: full; the memory estimate models only full)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds (each: one stapo and one justrl update)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "SEQ_LEN"), help=argparse.SUPPRESS)  # the worker
    p.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu --tiny for a smoke run)")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything initialises CUDA: cpu_compat applies
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.one:
        return worker(args, *args.one, device, dtype)
    rate = matmul_rate(device, 8192 if args.device == "cuda" else 512, dtype)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    models = ["tiny-qwen3"] if args.tiny else args.models
    seq_lens = [64, 128] if args.tiny else args.seq_lens
    name = torch.cuda.get_device_name(device) if args.device == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, dtype {dtype}, matmul rate {rate:.3g} TFLOP/s, "
          f"{args.num_microbatches} micro-batches of one sequence, recompute {args.recompute}, "
          f"{time.strftime('%Y-%m-%d')}, one process per row")
    print(f"{'model':>11} {'tokens':>6} {'update ms':>9} {'TFLOP/s':>8} {'of mm':>7} {'peak GB':>8} {'resv GB':>8} "
          f"{'est GB':>8} {'est-ovh':>8} {'st/justrl':>7}", flush=True)
    passed = [a for a in sys.argv[1:] if a not in ("--tiny",)]
    for model_name in models:
        for seq_len in seq_lens:
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                       LOCAL_RANK="0", WORLD_SIZE="1")
            cmd = [sys.executable, os.path.abspath(__file__), *passed, "--one", model_name, str(seq_len),
                   "--rate", str(rate)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
                print(f"{model_name:>11} {seq_len:>6} failed (exit {proc.returncode}): {tail[0]}", flush=True)
            else:
                print(proc.stdout.strip().splitlines()[-1], flush=True)


def worker(args, model_name: str, seq_len: str, device, dtype) -> None:
    """One (model, length) row in this fresh process."""
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel

    hf_config = tiny_config("qwen3") if model_name == "tiny-qwen3" else QWEN3_CONFIGS[model_name]
    init_parallel(1, 1)
    try:
        bench_one(model_name, hf_config, int(seq_len), args, device, dtype, args.rate)
    except torch.OutOfMemoryError:
        print(f"{model_name:>11} {seq_len:>6} out of memory", flush=True)
    destroy_parallel()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
