"""Benchmark: what tau_h_source="exact" (Algorithm 1) costs against "old", and how many silenced tokens differ.

One process, a small Megatron GPTModel (local spec, fp32), synthetic rollouts. A step is what the
trainer does per rollout batch after sampling, with the paper's 4 PPO mini-batches: the pi_old
pass over the whole batch, then per mini-batch the threshold, forward/backward and an AdamW step.
Two identical models (same seed) train on the same data, one per tau_H source; the variants run
interleaved each round and the median of the per-round time ratios exact / old is reported.
Time is this process's CPU time (``time.process_time``) with one intra-op thread by default: on
a shared machine the wall clock measures the neighbours' load (a load average near 100 made one
step of this tiny model take about 100 s of wall time; it takes about 1 s of CPU), the CPU time
of a single-threaded process much less so.

The silenced-token difference is measured on the same weights, so that only the threshold source
differs: before each update of the "exact" model, both thresholds are computed from its
statistics (tau_H of the current weights, as "exact" uses; tau_H of the pi_old pass, as "old"
uses) and the S2T masks they give on the current log-probs and entropies are compared (that
pre-computation is not timed). Mini-batch 1 of a step is on-policy, so both agree there by
construction; the table reports mini-batches 2-4.

    .venv/bin/python benchmarks/bench_tau_h_exact.py --rounds 5 --lr 1e-3   # benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import torch

from stapo_megatron.method import masks
from stapo_megatron.method.config import LossConfig
from stapo_megatron.mcore.loss import minibatch_threshold
from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy, old_policy_pass
from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel
from stapo_megatron.mcore.config import OptimConfig
from stapo_megatron.mcore.step import policy_update, wrap_model_and_optimizer
from stapo_megatron.recipes.synthetic import build_tiny_gpt, synthetic_rollouts, tiny_gpt_config
from malloc_check import check_jemalloc  # benchmarks/, the script's folder

NUM_MINIBATCHES = 4
"""PPO mini-batches per rollout batch (the paper: 256 / 64 prompts)."""


def _flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def _masks_on_same_weights(model, mini, old_stats, config, groups, seq_len):
    """(silenced with old tau_H, silenced with exact tau_H, tau_old, tau_exact) on the current weights."""
    current = compute_logprob_entropy(PassContext(model, seq_len, groups=groups), mini)
    adv, mask = _flat([mb.advantages for mb in mini]), _flat([mb.response_mask for mb in mini])
    lp_now, h_now = _flat([lp for lp, _ in current]), _flat([h for _, h in current])
    tau_exact = minibatch_threshold(config, lp_now, h_now, adv, mask)
    tau_old = minibatch_threshold(config, _flat([lp for lp, _ in old_stats]), _flat([h for _, h in old_stats]), adv, mask)
    with_old = masks.s2t_mask(lp_now, h_now, adv, mask, config.tau_p, tau_h=tau_old)
    with_exact = masks.s2t_mask(lp_now, h_now, adv, mask, config.tau_p, tau_h=tau_exact)
    return with_old, with_exact, float(tau_old), float(tau_exact)


def one_step(model, optimizer, groups, config, minis, seq_len, compare=None):
    """pi_old pass + one update per mini-batch; returns the timed CPU seconds (``compare``
    collects the same-weights mask comparison, untimed)."""
    seconds = 0.0
    t0 = time.process_time()
    ctx = PassContext(model, seq_len, config.temperature, groups)
    old_policy_pass(ctx, minis)
    seconds += time.process_time() - t0
    for k, mini in enumerate(minis):
        if compare is not None:
            stats = [(mb.old_logprob, mb.old_entropy) for mb in mini]
            compare.append((k, *_masks_on_same_weights(model, mini, stats, config, groups, seq_len)))
        t0 = time.process_time()
        policy_update(ctx, optimizer, mini, config)
        seconds += time.process_time() - t0
    return seconds


def main():
    parser = argparse.ArgumentParser(description="tau_h_source exact vs old: step time and silenced tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=96)
    parser.add_argument("--sequences", type=int, default=16, help="sequences per rollout batch (4 mini-batches)")
    parser.add_argument("--lr", type=float, default=1e-4, help="AdamW lr: how far each mini-batch moves the policy")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU time is measured)")
    args = parser.parse_args()
    check_jemalloc()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29656")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    groups = init_parallel(1, 1)
    config = tiny_gpt_config(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=8,
                             num_query_groups=4, kv_channels=32, ffn_hidden_size=4 * args.hidden)
    prompt = 32
    variants = {}
    for source in ("old", "exact"):
        model = build_tiny_gpt(config, args.vocab, args.seq)  # same seed: identical initial weights
        variants[source] = (*wrap_model_and_optimizer(model, OptimConfig(lr=args.lr, weight_decay=0.0)),
                            LossConfig(method="stapo", tau_h_source=source))
    times, ratios, compare = {s: [] for s in variants}, [], []
    per_mini = args.sequences // NUM_MINIBATCHES
    for rnd in range(args.rounds + 1):  # round 0 warms up
        mbs, _ = synthetic_rollouts(args.sequences // 4, 4, prompt, args.seq - prompt, args.vocab, seed=rnd,
                                    micro_batch_size=per_mini // 2)
        this_round = {}
        for source, (model, optimizer, loss_config) in variants.items():
            minis = [[dataclasses.replace(mb) for mb in mbs[k * 2:(k + 1) * 2]] for k in range(NUM_MINIBATCHES)]
            this_round[source] = one_step(model, optimizer, groups, loss_config, minis, args.seq,
                                          compare if (source == "exact" and rnd) else None)
            print(f"round {rnd} {source:6s} {this_round[source]:6.3f} CPU s", flush=True)
        if rnd:
            for source in variants:
                times[source].append(this_round[source])
            ratios.append(this_round["exact"] / this_round["old"])
    print("\n| tau_h_source | step CPU time (s, median) | ratio to old (median of rounds) |")
    print("| --- | --- | --- |")
    for source in variants:
        ratio = 1.0 if source == "old" else statistics.median(ratios)
        print(f"| {source} | {statistics.median(times[source]):.3f} | {ratio:.3f}x |")
    print(f"\nper-round ratios exact/old: {', '.join(f'{r:.3f}' for r in ratios)}")
    later = [c for c in compare if c[0] > 0]
    n_old = sum(int(c[1].sum()) for c in later)
    n_exact = sum(int(c[2].sum()) for c in later)
    n_diff = sum(int((c[1] ^ c[2]).sum()) for c in later)
    first_diff = sum(int((c[1] ^ c[2]).sum()) for c in compare if c[0] == 0)
    tau_gap = statistics.median(abs(c[3] - c[4]) for c in later)
    print(f"\nmini-batches 2-{NUM_MINIBATCHES} of {args.rounds} steps, same weights: silenced with old tau_H "
          f"{n_old}, with exact tau_H {n_exact}, in one set only {n_diff} "
          f"({n_diff / max(n_exact, 1):.1%} of exact's); median |tau_old - tau_exact| {tau_gap:.4f} nats; "
          f"mini-batch 1 (on-policy) differs in {first_diff}")
    destroy_parallel()


if __name__ == "__main__":
    main()
