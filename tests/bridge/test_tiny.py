"""Tier a: the tiny-model factory of `bridge.tiny`: specs, their config.json and the models built from them."""

import dataclasses

import pytest
import torch

from stapo_megatron.bridge.hf_config import spec_from_hf_config
from stapo_megatron.bridge.tiny import (
    QWEN3_TINY,
    TINY_CONFIGS,
    build_hf_model,
    hf_config_from_spec,
    tiny_config,
    tiny_qwen3_spec,
    transformers_config,
)

MOE = tiny_qwen3_spec(architecture="Qwen3MoeForCausalLM", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                      norm_topk_prob=True, moe_aux_loss_coeff=0.001)


@pytest.mark.parametrize("variant", sorted(TINY_CONFIGS))
def test_config_json_of_a_spec_reads_back_as_that_spec(variant):
    spec = spec_from_hf_config(tiny_config(variant))
    assert spec_from_hf_config(hf_config_from_spec(spec)) == spec


@pytest.mark.parametrize("spec", [QWEN3_TINY, MOE], ids=["qwen3", "qwen3-moe"])
def test_transformers_config_of_a_spec_reads_back_as_that_spec(spec):
    config = transformers_config(spec, eos_token_id=1, pad_token_id=0)
    assert spec_from_hf_config(config) == spec
    assert (config.eos_token_id, config.pad_token_id, config.head_dim) == (1, 0, 32)


def test_bad_spec_fields_are_refused_by_name():
    with pytest.raises(TypeError, match="num_heads"):
        tiny_qwen3_spec(num_heads=8)
    with pytest.raises(ValueError, match="add_qkv_bias=True"):
        hf_config_from_spec(dataclasses.replace(QWEN3_TINY, add_qkv_bias=True))


def test_same_spec_and_seed_give_the_same_weights():
    config = transformers_config(tiny_qwen3_spec(vocab_size=100))
    a, b, c = build_hf_model(config, seed=3), build_hf_model(config, seed=3), build_hf_model(config, seed=4)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_synthetic_transformer_config_is_the_spec_on_cpu_kernels():
    from stapo_megatron.recipes.synthetic import tiny_gpt_config

    config = tiny_gpt_config(2, 1, num_layers=3, hidden_size=128, kv_channels=16)
    assert (config.num_layers, config.hidden_size, config.kv_channels, config.num_query_groups) == (3, 128, 16, 2)
    assert (config.layernorm_epsilon, config.qk_layernorm, config.add_qkv_bias) == (1e-6, True, False)
    assert config.tensor_model_parallel_size == 2 and config.calculate_per_token_loss and config.use_cpu_initialization
    assert not any((config.bias_dropout_fusion, config.bias_activation_fusion, config.apply_rope_fusion,
                    config.masked_softmax_fusion, config.gradient_accumulation_fusion, config.persist_layer_norm))


def test_recipe_models_come_from_the_factory():
    from stapo_megatron.recipes.tiny import tiny_qwen3_config, tiny_qwen3_moe_config

    dense = spec_from_hf_config(tiny_qwen3_config(100, 1, 0))
    assert dense == tiny_qwen3_spec(num_layers=3, hidden_size=128, ffn_hidden_size=384, vocab_size=100,
                                    max_position_embeddings=512, rotary_base=10000.0)
    moe = spec_from_hf_config(tiny_qwen3_moe_config(100, 1, 0))
    assert moe == dataclasses.replace(dense, architecture="Qwen3MoeForCausalLM", num_moe_experts=4, moe_router_topk=2,
                                      moe_ffn_hidden_size=128, norm_topk_prob=True, moe_aux_loss_coeff=0.001)
