"""Tier a: every HF config field the bridge maps, per Qwen variant, and the rejections."""

import pytest

from stapo_megatron.bridge import SUPPORTED_ARCHITECTURES, padded_vocab_size, spec_from_hf_config
from stapo_megatron.bridge.tiny import tiny_config
from tests.helpers.qwen_configs import QWEN25_7B, QWEN3_14B


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
