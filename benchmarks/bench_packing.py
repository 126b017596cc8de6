"""Padded [N, S] vs packed token-budget micro-batches through one STAPO policy update (CPU).

Rollout lengths follow the paper's regime, scaled down for the CPU by ``--scale`` (default 32):
prompt uniform in [100, 1024] tokens, response log-normal with median 3000 and sigma 0.9,
capped at 15360; each length is divided by the scale (prompt 3-32, response median ~94, cap 480).
Padded is the trainer's "padded" mode with the paper recipes' micro_batch_size 1: every sequence
right-padded to the step's longest. Packed is "budget" with max_tokens_per_microbatch = the
padded micro-batch's tokens (the longest possible sequence), so both bound a micro-batch alike.

Reported: computed / real tokens, time per real token (old-policy pass + update on the tiny
Qwen3-shaped GPT of ``recipes.synthetic``, interleaved pairs in one process, median of per-pair
ratios), peak RSS of each side run alone in a fresh process, and the DP imbalance (max / mean
real tokens per rank) at the paper's step (256 prompts x 8, DP 8) at full scale from the plans.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \\
    MALLOC_CONF="retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1" \\
    PYTHONPATH=. .venv/bin/python benchmarks/bench_packing.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from malloc_check import check_jemalloc  # benchmarks/, the script's folder

PROMPT_RANGE, RESPONSE_MEDIAN, RESPONSE_SIGMA, RESPONSE_CAP = (100, 1024), 3000, 0.9, 15360
VOCAB = 512


def lengths(num: int, group: int, scale: int, seed: int):
    """(prompt_len, response_len) per sequence: G responses per prompt, lengths divided by scale."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num // group):
        prompt = int(torch.randint(PROMPT_RANGE[0], PROMPT_RANGE[1] + 1, (1,), generator=gen))
        for _ in range(group):
            z = float(torch.randn(1, generator=gen))
            response = min(RESPONSE_CAP, int(RESPONSE_MEDIAN * torch.exp(torch.tensor(RESPONSE_SIGMA * z))))
            out.append((max(1, prompt // scale), max(1, response // scale)))
    return out


def rollouts(lens, seed: int):
    from stapo_megatron.batch.microbatch import group_advantages

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (p,), generator=gen).tolist() for p, _ in lens]
    responses = [torch.randint(1, VOCAB, (r,), generator=gen).tolist() for _, r in lens]
    rewards = (torch.rand(len(lens) // 8, 8, generator=gen) < 0.5).float()
    return prompts, responses, group_advantages(rewards)[0].reshape(-1).tolist(), [[-0.5] * len(r) for r in responses]


def microbatches(mode: str, data, cap: int):
    from stapo_megatron.batch.minibatches import MicroBatchLayout, build_minibatches
    from stapo_megatron.batch.records import records_from_lists

    # the trainer's builder: padded rows to the longest sequence (rounded to 8), or the token budget
    layout = MicroBatchLayout("padded" if mode == "padded" else "budget", micro_batch_size=1, max_tokens=cap,
                         seq_multiple=8)
    (mbs,), _ = build_minibatches(records_from_lists(*data), layout)
    return mbs


def one_update(model, optimizer, groups, mbs):
    from stapo_megatron.method.config import LossConfig
    from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
    from stapo_megatron.mcore.step import policy_update

    for mb in mbs:
        mb.old_logprob = mb.old_entropy = None
    ctx = PassContext(model, max(mb.tokens.shape[1] for mb in mbs), groups=groups)
    start = time.perf_counter()
    old_policy_pass(ctx, [mbs])
    policy_update(ctx, optimizer, mbs, LossConfig(method="stapo"))
    return time.perf_counter() - start


def setup(args):
    from tests.helpers.dist_utils import single_process_env

    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.mcore.step import wrap_model_and_optimizer
    from stapo_megatron.recipes.synthetic import build_tiny_gpt, tiny_gpt_config

    env = single_process_env()
    env.__enter__()
    groups = init_parallel(1, 1)
    cfg = tiny_gpt_config(num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
                          kv_channels=32, ffn_hidden_size=384)
    model = build_tiny_gpt(cfg, VOCAB, 1024, core_attention="sdpa")
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(optimizer="sgd", lr=1e-3, weight_decay=0.0))
    lens = lengths(args.sequences, 8, args.scale, args.seed)
    cap = -(-(PROMPT_RANGE[1] // args.scale + RESPONSE_CAP // args.scale) // 8) * 8
    return model, optimizer, groups, rollouts(lens, args.seed), cap


def child(args):
    """One side alone in this process: its peak RSS."""
    model, optimizer, groups, data, cap = setup(args)
    one_update(model, optimizer, groups, microbatches(args.side, data, cap))
    print(json.dumps({"maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def imbalance_at_paper_scale(seed: int):
    """DP 8, 256 x 8 sequences at full length: padded (contiguous equal counts) vs the budget plan."""
    from stapo_megatron.batch.packing import imbalance, plan_fixed_count, plan_token_budget

    lens = [p + r for p, r in lengths(2048, 8, 1, seed)]
    mini = lens[:512]  # one PPO mini-batch (64 prompts x 8)
    padded = imbalance(plan_fixed_count(len(mini), 1, 8), mini)
    packed = imbalance(plan_token_budget(mini, 16384, 8, seed), mini)
    computed_padded = len(lens) * -(-max(lens) // 8) * 8 / sum(lens)
    return padded, packed, computed_padded


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--scale", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=("padded", "packed"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.side:
        return child(args)
    check_jemalloc()  # the RSS children inherit this process's environment
    model, optimizer, groups, data, cap = setup(args)
    sides = {s: microbatches(s, data, cap) for s in ("padded", "packed")}
    real = sum(len(p) + len(r) for p, r in zip(data[0], data[1]))
    one_update(model, optimizer, groups, sides["padded"])  # warm-up pair
    one_update(model, optimizer, groups, sides["packed"])
    times = {"padded": [], "packed": []}
    for _ in range(args.reps):
        for side in ("padded", "packed"):
            times[side].append(one_update(model, optimizer, groups, sides[side]))
    ratio = statistics.median(b / a for a, b in zip(times["padded"], times["packed"]))
    rss = {}
    for side in ("padded", "packed"):
        out = subprocess.run([sys.executable, __file__, "--side", side, "--sequences", str(args.sequences),
                              "--scale", str(args.scale), "--seed", str(args.seed)],
                             capture_output=True, text=True, check=True, env=dict(os.environ))
        rss[side] = json.loads(out.stdout.strip().splitlines()[-1])["maxrss_mb"]
    dp_padded, dp_packed, full_padded = imbalance_at_paper_scale(args.seed)
    print(f"{args.sequences} sequences, lengths / {args.scale}: real tokens {real}, longest "
          f"{max(len(p) + len(r) for p, r in zip(data[0], data[1]))}, budget {cap}")
    print("| side | micro-batches | computed / real tokens | time per update (s, median) | time per real token (us) "
          "| peak RSS alone (MB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for side, mbs in sides.items():
        computed = sum(mb.tokens.numel() for mb in mbs)
        t = statistics.median(times[side])
        print(f"| {side} | {len(mbs)} | {computed / real:.3f} | {t:.2f} | {1e6 * t / real:.1f} | {rss[side]:.0f} |")
    print(f"time per real token packed / padded (median of {args.reps} interleaved pairs): {ratio:.2f}x")
    print(f"paper scale (2048 sequences, full lengths): computed / real padded to the step's longest "
          f"{full_padded:.2f}; DP=8 imbalance (max/mean tokens per rank) of a mini-batch: padded equal counts "
          f"{dp_padded:.3f}, token budget 16384 {dp_packed:.3f}")


if __name__ == "__main__":
    main()
