"""The tiny Qwen3-MoE policy synced into a transformers engine, as the MoE weight-sync and
router-replay tests build it: expert-aware random weights, and the EP=2 and TP=2 / PP=2 gloo
workers that sync the policy and count the routes it disagrees on with the engine.
"""

import math

import torch

from stapo_megatron.bridge.tiny import tiny_config
from tests.helpers.engine_parity import randomize

LOGPROB_ATOL = 1e-4
"""Per token, fp32 on both sides (HF's eager experts and SDPA vs Megatron's SequentialMLP and
local spec round differently, ~1e-6); a swapped expert or gate/up moves log-probs by O(0.1)."""

VARIANT = "qwen3-moe"
PROMPTS = [[5, 17, 200, 3], [42] * 6]


def randomize_experts(model, seed: int) -> None:
    """O(1)-logit weights (matrices N(0, 1/fan_in), norms 1 + N(0, 0.1^2)): expert parameters
    from a generator of this EP rank, every other parameter alike on all ranks (EP is carved
    out of DP, whose replicas must agree)."""
    from megatron.core import parallel_state as ps

    shared = torch.Generator().manual_seed(seed)
    own = torch.Generator().manual_seed(seed + 1000 * (1 + ps.get_expert_model_parallel_rank()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = own if ".experts." in name else shared
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))


def _ep2_worker(hf_dir: str, tokens_BS: torch.Tensor, save_dir: str) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import iter_hf_weights, sync_weights
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.trainer.routing import routing_counts, sample_microbatches
    from tests.helpers.engine_parity import hf_logprobs, megatron_logprobs

    groups = init_parallel(1, 1, expert_model_parallel_size=2)
    model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32)
    randomize_experts(model, seed=5)
    model.eval()
    dist_checkpointing.save(model.sharded_state_dict(), save_dir)  # the converter's reference (below)
    streamed = {name: t.clone() for name, t in iter_hf_weights(model, tiny_config(VARIANT), groups)}
    engine = HFEngine(hf_dir, RolloutConfig(dtype="float32", return_routed_experts=True))
    before = hf_logprobs(engine, tokens_BS)
    stats = sync_weights(model, tiny_config(VARIANT), groups, engine)
    after = hf_logprobs(engine, tokens_BS)
    megatron = megatron_logprobs(model, tokens_BS, groups.tp, 1.0)
    # each rank its own samples (different seeds), as DP ranks have
    samples = engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=dist.get_rank())
    flat = [s for g in samples for s in g]
    counts = routing_counts(model, sample_microbatches([p for p in PROMPTS for _ in range(2)], flat, 2, pad_id=0), 4)
    dist.all_reduce(counts)
    local_experts = sorted({n.split(".local_experts.")[1].split(".")[0] for n, _ in model.named_parameters()
                            if ".local_experts." in n})
    return dict(before=before, after=after, megatron=megatron, stats=stats, counts=counts, local_experts=local_experts,
                routed_tokens=sum(s.routed_experts.shape[0] for s in flat), streamed=streamed)


def _tp2_worker(hf_dir: str, tokens_BS: torch.Tensor, layout: str) -> dict:
    """TP=2 with sequence parallelism (experts split over expert-TP = 2: the gate/up split per
    shard, and each TP rank routes half of every sequence) or PP=2 (each stage routes its own
    layers): sync, then the routes against the engine's."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.mcore.parallel import init_parallel
    from stapo_megatron.trainer.routing import routing_counts, sample_microbatches
    from tests.helpers.engine_parity import hf_logprobs, megatron_logprobs
    import torch.distributed as dist

    tp2 = layout == "tp2-sp"
    groups = init_parallel(2, 1) if tp2 else init_parallel(1, 2)
    model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32,
                            **(dict(sequence_parallel=True) if tp2 else {}))
    randomize(model, seed=9)  # TP-sharded experts draw per TP rank
    model.eval()
    engine = HFEngine(hf_dir, RolloutConfig(dtype="float32", return_routed_experts=True))
    sync_weights(model, tiny_config(VARIANT), groups, engine)
    # the ranks of a model-parallel group train on the same samples (the trainer broadcasts them)
    flat = [s for g in engine.generate(PROMPTS, n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=3) for s in g]
    counts = routing_counts(model, sample_microbatches([p for p in PROMPTS for _ in range(2)], flat, 2, pad_id=0), 4)
    dist.all_reduce(counts)
    return dict(counts=counts, routed_tokens=sum(s.routed_experts.shape[0] for s in flat),
                logprobs=hf_logprobs(engine, tokens_BS),
                megatron=megatron_logprobs(model, tokens_BS, groups.tp, 1.0) if tp2 else None)
