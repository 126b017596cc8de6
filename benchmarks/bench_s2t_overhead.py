"""Benchmark: training-step time of STAPO (S2T mask) vs JustRL (no mask), and of the two tau_H sources.

One process, a small Megatron GPTModel (local spec, fp32), synthetic rollouts. A "step" is what
the trainer does per rollout batch after sampling: the pi_old pass (log-probs + entropies) and the
policy update (threshold, forward/backward with the loss, optimizer step). The three variants run
interleaved on the same data, and the medians of per-round ratios against justrl are reported:

- justrl:      no mask (the DAPO/JustRL objective);
- stapo/old:   S2T with tau_H from the pi_old pass (the default);
- stapo/exact: S2T with tau_H from a no-grad pre-pass with the current weights.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
    MALLOC_CONF="retain:true,dirty_decay_ms:-1,muzzy_decay_ms:-1" \
    .venv/bin/python benchmarks/bench_s2t_overhead.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from stapo_megatron.method.config import LossConfig

from stapo_megatron.mcore.schedule import PassContext, old_policy_pass
from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel
from stapo_megatron.mcore.config import OptimConfig
from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
from stapo_megatron.recipes.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config
from malloc_check import check_jemalloc  # benchmarks/, the script's folder

VARIANTS = {
    "justrl": LossConfig(method="justrl"),
    "stapo/old": LossConfig(method="stapo", tau_h_source="old"),
    "stapo/exact": LossConfig(method="stapo", tau_h_source="exact"),
}


def one_step(model, optimizer, groups, loss_config, mbs, seq_len):
    t0 = time.perf_counter()
    ctx = PassContext(model, seq_len, loss_config.temperature, groups)
    old_policy_pass(ctx, [mbs])
    metrics = policy_update(ctx, optimizer, mbs, loss_config).metrics
    return time.perf_counter() - t0, metrics


def main():
    parser = argparse.ArgumentParser(description="S2T overhead benchmark")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    args = parser.parse_args()
    check_jemalloc()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29655")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    groups = init_parallel(1, 1)
    config = tiny_gpt_config(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
        num_query_groups=4, kv_channels=32, ffn_hidden_size=4 * args.hidden,
    )
    prompt = 64
    model = build_tiny_gpt(config, args.vocab, args.seq)
    model, optimizer = wrap_model_and_optimizer(model, OptimConfig(lr=1e-6))
    times = {name: [] for name in VARIANTS}
    ratios = {name: [] for name in VARIANTS}
    for rnd in range(args.rounds + 1):  # round 0 warms up
        mbs, _ = synthetic_rollouts(4, 4, prompt, args.seq - prompt, args.vocab, seed=rnd, micro_batch_size=4)
        this_round = {}
        for name, loss_config in VARIANTS.items():
            fresh = [dataclasses.replace(mb) for mb in mbs]  # each variant fills its own pi_old
            seconds, metrics = one_step(model, optimizer, groups, loss_config, fresh, args.seq)
            this_round[name] = seconds
            print(f"round {rnd} {name:12s} {seconds:6.3f} s  silenced {metrics['silenced_count']}", flush=True)
        if rnd:
            for name in VARIANTS:
                times[name].append(this_round[name])
                ratios[name].append(this_round[name] / this_round["justrl"])
    print("\n| variant | step time (s, median) | ratio vs justrl (median of rounds) |")
    print("| --- | --- | --- |")
    for name in VARIANTS:
        print(f"| {name} | {statistics.median(times[name]):.3f} | {statistics.median(ratios[name]):.3f}x |")
    destroy_parallel()


if __name__ == "__main__":
    main()
