"""Tier a: every HF config field the bridge maps, per Qwen variant, and the rejections."""

import pytest
import torch

from stapo_megatron.bridge import (
    SUPPORTED_ARCHITECTURES,
    check_parallel_sizes,
    padded_vocab_size,
    spec_from_hf_config,
    transformer_config_from_spec,
)
from stapo_megatron.bridge.tiny import tiny_config

# A Qwen2.5-7B-Instruct config.json as published (transformers-4 spelling: rope_theta, torch_dtype).
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
    "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 152064, "rope_scaling": None,
}
# Qwen3-14B-Base in transformers-5 spelling (rope_parameters), head_dim explicit.
QWEN3_14B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408, "max_position_embeddings": 32768,
    "model_type": "qwen3", "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen25_legacy_fields():
    s = spec_from_hf_config(QWEN25_7B)
    assert (s.num_layers, s.hidden_size, s.ffn_hidden_size) == (28, 3584, 18944)
    assert (s.num_attention_heads, s.num_query_groups, s.kv_channels) == (28, 4, 128)
    assert s.rotary_base == 1e6 and s.layernorm_epsilon == 1e-6 and s.max_position_embeddings == 32768
    assert s.add_qkv_bias and not s.qk_layernorm and not s.tie_word_embeddings


def test_qwen3_transformers5_fields():
    s = spec_from_hf_config(QWEN3_14B)
    assert (s.num_attention_heads, s.num_query_groups, s.kv_channels) == (40, 8, 128)
    assert s.rotary_base == 1e6 and s.qk_layernorm and not s.add_qkv_bias
    assert s.vocab_size == 151936 and padded_vocab_size(s.vocab_size, 8) == 152576


@pytest.mark.parametrize("variant", ["qwen2", "qwen2.5", "qwen3", "qwen3-tied"])
def test_transformer_config_never_uses_megatron_defaults(variant):
    cfg = tiny_config(variant)
    s = spec_from_hf_config(cfg)
    tc = transformer_config_from_spec(s, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert tc.layernorm_epsilon == cfg["rms_norm_eps"] == 1e-6  # Megatron default 1e-5
    assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0  # Megatron default 0.1
    assert tc.kv_channels == cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    assert tc.num_query_groups == cfg["num_key_value_heads"]
    assert tc.add_qkv_bias == (cfg["model_type"] == "qwen2")
    assert tc.qk_layernorm == (cfg["model_type"] == "qwen3")
    assert tc.normalization == "RMSNorm" and tc.gated_linear_unit and tc.activation_func is torch.nn.functional.silu
    assert not tc.add_bias_linear and tc.ffn_hidden_size == cfg["intermediate_size"]
    assert s.tie_word_embeddings == cfg["tie_word_embeddings"]
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    assert s.rotary_base == theta != 10000.0 or variant == "qwen2"


def test_qwen3_head_dim_differs_from_hidden_over_heads():
    s = spec_from_hf_config(tiny_config("qwen3"))
    assert s.kv_channels == 32 and s.hidden_size // s.num_attention_heads == 16


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_unsupported_architecture_lists_supported(arch):
    cfg = {**QWEN3_14B, "architectures": [arch]}
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        spec_from_hf_config(cfg)
    assert all(a in str(e.value) for a in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("change, match", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope type 'yarn'"),
    ({"use_sliding_window": True}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_features_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config({**QWEN3_14B, **change})


def test_tp_must_divide_heads_and_groups():
    s = spec_from_hf_config(QWEN3_14B)  # 40 heads, 8 groups
    check_parallel_sizes(s, 8, 4)
    with pytest.raises(ValueError, match="does not divide num_attention_heads 40"):
        check_parallel_sizes(s, 3)
    with pytest.raises(ValueError, match=r"does not divide num_query_groups \(num_key_value_heads\) 8"):
        check_parallel_sizes(s, 20)
    with pytest.raises(ValueError, match="does not divide num_layers 40"):
        check_parallel_sizes(s, 1, 3)


def test_padded_vocab_size():
    assert padded_vocab_size(300) == 384
    assert padded_vocab_size(300, tensor_model_parallel_size=4) == 512
    assert padded_vocab_size(384, 1) == 384
