"""What router replay (R3) changes in the train/rollout mismatch of a mixture-of-experts policy.

The tiny Qwen3-MoE (4 layers, 4 experts, top-2; `stapo_megatron.bridge.tiny`) with O(1)-logit
random weights is trained in fp32 by Megatron and sampled by the HF engine after a weight sync
(`rollout.weight_sync`), once with an fp32 engine and once with a bf16 engine (what a GPU
rollout runs). For each, Megatron recomputes the sampled tokens' log-probs (the pi_old pass,
`mcore.schedule.compute_logprob_entropy`) with its own routing and with the engine's routes
replayed (`mcore.router_replay`), and compares them with the sampler's log-probs per response
token, d = log pi_train - log pi_rollout:

- ``routing disagreement``: share of (token, layer) top-k sets where Megatron's own routing
  differs from the engine's (`trainer.routing`; replay forces these to agree);
- ``mean abs(d)``, ``p99 abs(d)``, ``max abs(d)`` and ``abs(d) > 0.1``: the share of tokens off by more
  than 0.1 nats (a flipped expert moves a log-prob by O(0.1-1); bf16 rounding by ~1e-2);
- ``KL``: the mean of the k3 estimator r - 1 - log r, r = exp(d), of KL(rollout || train) on the
  sampled tokens (the quantity truncated/masked importance sampling corrects for).

Counts, not times: the numbers depend on the seeds only (`--seed`), not on the machine's load;
no allocator check (`malloc_check`) is needed.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_router_replay.py
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

VARIANT = "qwen3-moe"


def mismatch(model, groups, microbatches, replay: bool) -> dict:
    """Per response token, Megatron's log-prob (own routing or replayed) against the sampler's."""
    from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy

    seq = microbatches[0].tokens.shape[1]
    ctx = PassContext(model, seq, 1.0, groups, model.qwen_spec.vocab_size, replay_routes=replay)
    stats = compute_logprob_entropy(ctx, microbatches)
    d = torch.cat([(lp - mb.rollout_logprob)[mb.response_mask] for (lp, _), mb in zip(stats, microbatches)]).double()
    k3 = torch.expm1(d) - d  # r - 1 - log r with r = exp(d): >= 0, unbiased for KL(rollout || train)
    return {"tokens": int(d.numel()), "mean abs(d)": float(d.abs().mean()),
            "p99 abs(d)": float(d.abs().quantile(0.99)), "max abs(d)": float(d.abs().max()),
            "abs(d) > 0.1": float((d.abs() > 0.1).double().mean()), "KL": float(k3.mean())}


def measure(args) -> list:
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.trainer.routing import routing_counts, routing_metrics, sample_microbatches
    from tests.helpers.dist_utils import one_rank_parallel
    from tests.rollout.test_moe_weight_sync import randomize_experts

    config = tiny_config(VARIANT)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, config["vocab_size"], (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, one_rank_parallel() as groups:
        save_tiny_hf_model(tmp, VARIANT, dtype=torch.float32, seed=args.seed)
        model = build_gpt_model(config, params_dtype=torch.float32, moe_enable_routing_replay=True)
        randomize_experts(model, seed=args.seed + 5)
        model.eval()
        for dtype in ("float32", "bfloat16"):
            engine = HFEngine(tmp, RolloutConfig(dtype=dtype, return_routed_experts=True))
            sync_weights(model, config, groups, engine)
            flat = [s for group in engine.generate(prompts, n=args.samples, temperature=1.0, top_p=1.0,
                                                   max_tokens=args.max_tokens, seed=args.seed) for s in group]
            mbs = sample_microbatches([p for p in prompts for _ in range(args.samples)], flat, args.samples, pad_id=0)
            routing = routing_metrics(routing_counts(model, mbs, config["num_experts"]), config["num_experts_per_tok"])
            for replay in (False, True):
                rows.append({"engine": dtype, "replay": replay,
                             "routing disagreement": routing["routing_disagreement_mean"],
                             **mismatch(model, groups, mbs, replay)})
            del engine
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = measure(args)
    cols = ["engine", "replay", "routing disagreement", "tokens", "mean abs(d)", "p99 abs(d)", "max abs(d)", "abs(d) > 0.1", "KL"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [r["engine"], "on" if r["replay"] else "off", f"{r['routing disagreement']:.2%}", str(r["tokens"])]
        cells += [f"{r[c]:.2e}" for c in ("mean abs(d)", "p99 abs(d)", "max abs(d)")]
        cells += [f"{r['abs(d) > 0.1']:.2%}", f"{r['KL']:.2e}"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
