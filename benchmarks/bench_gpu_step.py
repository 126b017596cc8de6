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

``--packing budget`` fills each micro-batch with whole sequences up to the --seq-lens token
budget (the trainer's ``packing="budget"``, SDPA's varlen path), their lengths drawn from the
paper's distribution as `bench_packing.py` draws them; the TFLOP/s count the real sequences
(attention within each), and the row ends with the sequences and the budget's fill.

    source .whl/gpu-env.sh && python3 benchmarks/bench_gpu_step.py            # the H100 run
    .venv/bin/python benchmarks/bench_gpu_step.py --device cpu --tiny          # a CPU smoke run
    python3 benchmarks/bench_gpu_step.py --models qwen3-1.7b --seq-lens 16384 --recompute none --packing budget
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from stapo_megatron.utils import free_port, local_rank_env

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


def packed_microbatches(spec, budget: int, num_microbatches: int, seed: int):
    """``num_microbatches`` budget-packed micro-batches of at most ``budget`` tokens (the trainer's
    "budget" packing), their sequences drawn from the paper's lengths as `bench_packing.py` draws
    them (prompt uniform in [100, 1024], response log-normal, median 3000, capped at 15360; scaled
    down so that the longest fits ``budget``). Returns (micro-batches, sequence lengths in them)."""
    from bench_packing import PROMPT_RANGE, RESPONSE_CAP, lengths, rollouts  # benchmarks/, this script's folder
    from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
    from stapo_megatron.batch.records import records_from_lists

    scale = max(1, -(-(PROMPT_RANGE[1] + RESPONSE_CAP) // budget))
    lens = lengths(8 * (num_microbatches + 1), 8, scale, seed)  # ~3 sequences per 16k budget: enough
    layout = MicroBatchLayout("budget", micro_batch_size=1, max_tokens=budget, seq_multiple=8)
    prompts, responses, advantages, logprobs = rollouts(lens, seed)
    prompts, responses = ([[t % spec.vocab_size for t in seq] for seq in seqs] for seqs in (prompts, responses))
    (mbs,), _ = build_minibatches(records_from_lists(prompts, responses, advantages, logprobs), layout)
    if len(mbs) < num_microbatches:
        raise ValueError(f"{len(lens)} sequences packed into {len(mbs)} < {num_microbatches} micro-batches")
    mbs = mbs[:num_microbatches]
    seqs = [int(n) for mb in mbs for n in (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist() if n > 0]
    return mbs, seqs


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
    packed = args.packing == "budget"
    model = build_gpt_model(hf_config, params_dtype=dtype, bf16=dtype == torch.bfloat16, calculate_per_token_loss=True,
                            core_attention="sdpa" if packed else None, **recompute)
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-6))
    if packed:  # the FLOPs of the real sequences (attention within each), not of the budget
        mbs, seqs = packed_microbatches(spec, seq_len, args.num_microbatches, seed=0)
        flops = sum(model_flops(spec, n, n) for n in seqs)
        fill = f" {len(seqs)} seqs, {sum(seqs) / (seq_len * args.num_microbatches):.0%} of the budget"
    else:
        mbs = microbatches(spec, seq_len, args.num_microbatches, seed=0)
        flops, fill = model_flops(spec, seq_len * args.num_microbatches, seq_len), ""
    rows = max(mb.tokens.shape[1] for mb in mbs)  # packed: the longest packed row (bench_packing.py)
    ctx = PassContext(model, rows, groups=groups, vocab_size=spec.vocab_size)
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
    tflops = flops / t / 1e12
    # the memory model of every recompute mode ("selective" is counted as none there)
    layout = ParallelLayout(num_nodes=1, gpus_per_node=1, vllm_tensor_parallel_size=1,
                            vllm_gpu_memory_utilization=0.0, model=ModelConfig(**recompute))
    estimate = memory_estimate(spec, layout, seq_len=seq_len)
    peak = torch.cuda.max_memory_allocated() / GB if device.type == "cuda" else float("nan")
    reserved = torch.cuda.max_memory_reserved() / GB if device.type == "cuda" else float("nan")
    print(f"{name:>11} {seq_len:>6} {t * 1e3:>9.1f} {tflops:>8.3g} {tflops / rate:>7.1%} {peak:>8.1f} {reserved:>8.1f} "
          f"{_gb(estimate and estimate.training):>8} {_gb(estimate and estimate.training - estimate.overhead):>8} "
          f"{ratio:>7.3f}{fill}", flush=True)


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
    p.add_argument("--packing", choices=["none", "budget"], default="none",
                   help="budget: each micro-batch packs sequences of the paper's lengths into the --seq-lens budget "
                        "(the trainer's packing='budget'); none: one sequence of that length")
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
          f"{args.num_microbatches} micro-batches of "
          f"{'packed sequences (budget = tokens)' if args.packing == 'budget' else 'one sequence'}, "
          f"recompute {args.recompute}, "
          f"{time.strftime('%Y-%m-%d')}, one process per row")
    print(f"{'model':>11} {'tokens':>6} {'update ms':>9} {'TFLOP/s':>8} {'of mm':>7} {'peak GB':>8} {'resv GB':>8} "
          f"{'est GB':>8} {'est-ovh':>8} {'st/justrl':>7}", flush=True)
    passed = [a for a in sys.argv[1:] if a not in ("--tiny",)]
    for model_name in models:
        for seq_len in seq_lens:
            env = dict(os.environ, **local_rank_env(0, 1, free_port()))
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


if __name__ == "__main__":
    main()
