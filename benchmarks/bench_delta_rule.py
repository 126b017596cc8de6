"""The CPU gated delta rule: megatron-core's torch reference (``torch_chunk_gated_delta_rule``) vs
`stapo_megatron.mcore.delta_rule.chunk_gated_delta_rule`, forward + backward, fp32.

Shapes ([batch, tokens, heads, head dim], key and value dims equal):

- ``demo-sequence``: one packed sequence of the tiny Qwen3.5 demo (48 tokens, its 4 value heads
  of 32; its packed delta-net layers call the rule once a sequence);
- ``demo-batch``: 16 padded sequences of 64 tokens at the same heads (the warm-start's batches);
- ``realistic``: 2048 tokens of 12 heads of 128 (Qwen3.5-27B's 48 value heads over TP 4).

Each repetition times the two kernels back to back on the same inputs (interleaved pairs after
one warm-up pair); reported: median seconds of each, tokens/s (batch x tokens / seconds) and the
median of the per-pair time ratios (reference / ours: the speed-up). The outputs' max difference
relative to the reference's max is printed beside them (both fp32).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \\
    MALLOC_CONF="retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1" \\
    PYTHONPATH=. .venv/bin/python benchmarks/bench_delta_rule.py --reps 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from malloc_check import check_jemalloc  # benchmarks/, the script's folder

SHAPES = {"demo-sequence": (1, 48, 4, 32), "demo-batch": (16, 64, 4, 32), "realistic": (1, 2048, 12, 128)}


def inputs(batch: int, tokens: int, heads: int, dim: int, seed: int = 0):
    """q, k unit-norm (the layer L2-normalises them), log decays < 0, write strengths in (0, 1); all
    requiring gradients."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(batch, tokens, heads, dim, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(batch, tokens, heads, dim, generator=gen)
    g = -F.softplus(torch.randn(batch, tokens, heads, generator=gen))
    beta = torch.sigmoid(torch.randn(batch, tokens, heads, generator=gen))
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def fwd_bwd(kernel, args, weight) -> tuple:
    """Seconds of one forward + backward of sum(weight * o), and o."""
    for t in args:
        t.grad = None
    start = time.perf_counter()
    out, _ = kernel(*args[:3], g=args[3], beta=args[4], initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False)
    (out * weight).sum().backward()
    return time.perf_counter() - start, out.detach()


def bench(name: str, reps: int) -> dict:
    from megatron.core.ssm import gated_delta_net

    from stapo_megatron.mcore.delta_rule import chunk_gated_delta_rule

    reference = getattr(gated_delta_net, "common", gated_delta_net).torch_chunk_gated_delta_rule
    batch, tokens, heads, dim = SHAPES[name]
    args = inputs(batch, tokens, heads, dim)
    weight = torch.randn(batch, tokens, heads, dim, generator=torch.Generator().manual_seed(1))
    times = {"reference": [], "ours": []}
    for rep in range(reps + 1):  # the first pair warms up
        t_ref, out_ref = fwd_bwd(reference, args, weight)
        t_ours, out_ours = fwd_bwd(chunk_gated_delta_rule, args, weight)
        if rep:
            times["reference"].append(t_ref)
            times["ours"].append(t_ours)
    med = {side: statistics.median(ts) for side, ts in times.items()}
    return dict(shape=name, batch=batch, tokens=tokens, heads=heads, dim=dim,
                reference_s=round(med["reference"], 4), ours_s=round(med["ours"], 4),
                reference_tok_s=round(batch * tokens / med["reference"], 1),
                ours_tok_s=round(batch * tokens / med["ours"], 1),
                speedup=round(statistics.median(r / o for r, o in zip(times["reference"], times["ours"])), 2),
                rel_diff=float((out_ours - out_ref).abs().max() / out_ref.abs().max()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed pairs a shape (after one warm-up pair)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: as each process of the 2-process demo, which torchrun starts with "
                             "OMP_NUM_THREADS=1)")
    args = parser.parse_args()
    check_jemalloc()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    print("| shape | [B, T, H, D] | reference fwd+bwd (s) | ours (s) | reference tok/s | ours tok/s | "
          "speed-up (median of pairs) | max rel. diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.shapes:
        row = bench(name, args.reps)
        print(f"| {name} | [{row['batch']}, {row['tokens']}, {row['heads']}, {row['dim']}] | {row['reference_s']} | "
              f"{row['ours_s']} | {row['reference_tok_s']} | {row['ours_tok_s']} | {row['speedup']}x | "
              f"{row['rel_diff']:.1e} |", flush=True)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
