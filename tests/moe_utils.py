"""A tiny Qwen3-MoE HF folder for the rollout tests (transformers' ``Qwen3MoeConfig``).

Stand-in until `stapo_megatron.bridge.tiny` builds the MoE variant (moe-model's branch).
"""

import math

import torch

TINY_MOE = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, intermediate_size=96,
    moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300, tie_word_embeddings=False,
    attention_bias=False, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu",
    router_aux_loss_coef=0.001, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
)


def save_tiny_moe(path: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Save a tiny Qwen3-MoE with O(1) logits (matrices N(0, 1/fan_in), norms 1 + N(0, 0.1^2))."""
    import transformers

    config = transformers.Qwen3MoeConfig(**{k: v for k, v in TINY_MOE.items() if k not in ("architectures", "model_type")})
    config.architectures = TINY_MOE["architectures"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
            else:
                p.normal_(1.0, 0.1)
    model.to(dtype).save_pretrained(path)
    return model
