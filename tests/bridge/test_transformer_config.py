"""Tier a: the Megatron TransformerConfig built from a Qwen spec never takes a Megatron default
(eps, dropout, rotary base, kv_channels), the parallel sizes it accepts, the padded vocabulary."""

import pytest
import torch

from stapo_megatron.bridge import (check_parallel_sizes, padded_vocab_size, spec_from_hf_config,
                                   transformer_config_from_spec)
from stapo_megatron.bridge.tiny import tiny_config
from tests.helpers.qwen_configs import QWEN3_14B


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
