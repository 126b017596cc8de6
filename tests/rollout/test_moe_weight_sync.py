"""The streamed weight sync of a Qwen3-MoE policy at EP=2 (tier b), and the routing disagreement.

Two gloo ranks build the tiny Qwen3-MoE (4 experts, top-2) as a Megatron GPTModel with expert
parallelism 2 (2 local experts per rank, each rank's drawn from its own generator, so a wrong
local -> global expert index shows) and random weights B; each rank holds an `HFEngine` loaded
with weights A and syncs B into it. Then per rank:

- the streamed HF tensors equal `stapo-convert mcore-to-hf`'s export of the same weights saved
  as an EP=2 dist checkpoint, bit for bit (both only move fp32 values);
- the engine's log-probs of fixed sequences equal Megatron's (LOGPROB_ATOL; before the sync
  they differ by O(1)), so every expert, router and norm arrived under the right name;
- the engine's samples carry the routes it generated with, and `routing_counts` (a Megatron
  pass with router hooks, summed over both ranks) finds no (token, layer) whose top-2 set
  differs: both sides are fp32 and the router logits of random O(1) weights are far apart
  compared with the ~1e-6 kernel differences.

At TP=2 with sequence parallelism (experts split over expert-TP) and at PP=2, the same sync and
route agreement, every (token, layer) counted once over the model-parallel ranks. And in one
process: with a bf16 engine the same measurement is nonzero (precision flips
near-ties), which is what the metric exists to show.
"""

import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from tests.helpers.moe_sync_workers import VARIANT, randomize_experts


def test_bf16_engine_routes_differ_from_fp32_training(parallel, tmp_path):
    """One process: the same synced weights, an fp32 engine agrees with the fp32 Megatron
    routing on every token and layer, a bf16 engine does not (bf16 rounds the router logits by
    ~1e-2 relative, enough to flip near-ties: measured 1.7% of (token, layer) sets, 0.7% in the
    first layer to 3.1% in the last). Upper bound BF16_MAX: rounding flips only near-ties, a
    wrong expert mapping would disagree on most tokens."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.weight_sync import sync_weights
    from stapo_megatron.trainer.routing import routing_counts, routing_metrics, sample_microbatches

    BF16_MAX = 0.2
    hf_dir = str(tmp_path / "hf")
    save_tiny_hf_model(hf_dir, VARIANT, dtype=torch.float32, seed=0)
    model = build_gpt_model(tiny_config(VARIANT), params_dtype=torch.float32)
    randomize_experts(model, seed=5)
    model.eval()
    prompts = [torch.randint(0, 300, (12,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)]
    result = {}
    for dtype in ("float32", "bfloat16"):
        engine = HFEngine(hf_dir, RolloutConfig(dtype=dtype, return_routed_experts=True))
        sync_weights(model, tiny_config(VARIANT), parallel, engine)
        flat = [s for g in engine.generate(prompts, n=4, temperature=1.0, top_p=1.0, max_tokens=20, seed=0) for s in g]
        counts = routing_counts(model, sample_microbatches([p for p in prompts for _ in range(4)], flat, 8, pad_id=0), 4)
        result[dtype] = routing_metrics(counts, top_k=2)
    assert result["float32"]["routing_disagreement_max"] == 0.0
    assert 0.0 < result["bfloat16"]["routing_disagreement_mean"] <= BF16_MAX


