"""Tier a: the Qwen3-MoE bridge. Config mapping (every field, refused variants), the router
settings that make Megatron's routing equal HF's, mapping rows, the bit-exact conversion round
trip, and Megatron's router probabilities against transformers' on the same logits."""

import json
import os

import pytest
import torch

from stapo_megatron.bridge import spec_from_hf_config, transformer_config_from_spec
from stapo_megatron.bridge.transformer_config import check_parallel_sizes
from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
from stapo_megatron.conversion.cli import main
from stapo_megatron.conversion.dcp_io import CheckpointReader
from tests.helpers.conversion_parity import _assert_bit_exact

# Qwen3-30B-A3B's config.json (released spelling: num_experts; transformers-5 rope_parameters).
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
    router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
    rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, attention_bias=False,
    rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"}, output_router_logits=False)


def test_qwen3_30b_a3b_fields():
    s = spec_from_hf_config(QWEN3_30B_A3B)
    assert s.is_moe and s.architecture == "Qwen3MoeForCausalLM"
    assert (s.num_moe_experts, s.moe_router_topk, s.moe_ffn_hidden_size) == (128, 8, 768)
    assert s.norm_topk_prob and s.moe_aux_loss_coeff == 0.001
    assert s.qk_layernorm and not s.add_qkv_bias and s.kv_channels == 128
    # transformers 5 saves the expert count as num_local_experts
    alias = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert spec_from_hf_config({**alias, "num_local_experts": 128}) == s


@pytest.mark.parametrize("change, match", [
    ({"shared_expert_intermediate_size": 5632}, "shared_expert_intermediate_size 5632"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step 2"),
    ({"mlp_only_layers": [0, 47]}, r"mlp_only_layers \[0, 47\]"),
    ({"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok 129"),
    ({"num_local_experts": 64}, "num_experts 128 and num_local_experts 64 differ"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_moe_variants_are_refused_naming_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        spec_from_hf_config({**QWEN3_30B_A3B, **change})


def test_expert_parallel_sizes_are_checked():
    s = spec_from_hf_config(QWEN3_30B_A3B)
    check_parallel_sizes(s, 4, 2, expert_model_parallel_size=8, expert_tensor_parallel_size=1)
    with pytest.raises(ValueError, match="expert_model_parallel_size 3 does not divide num_moe_experts"):
        check_parallel_sizes(s, 1, 1, expert_model_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size 5 does not divide moe_ffn_hidden_size"):
        check_parallel_sizes(s, 1, 1, expert_tensor_parallel_size=5)
    with pytest.raises(ValueError, match="needs a MoE model"):
        check_parallel_sizes(spec_from_hf_config(tiny_config("qwen3")), 1, 1, expert_model_parallel_size=2)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_settings(norm_topk_prob):
    s = spec_from_hf_config({**QWEN3_30B_A3B, "norm_topk_prob": norm_topk_prob})
    tc = transformer_config_from_spec(s, expert_model_parallel_size=8)
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (128, 8, 768)
    assert tc.moe_router_score_function == "softmax" and tc.moe_router_pre_softmax == (not norm_topk_prob)
    assert tc.moe_router_load_balancing_type == "aux_loss" and tc.moe_aux_loss_coeff == 0.001
    assert tc.moe_token_dispatcher_type == "alltoall" and tc.expert_model_parallel_size == 8
    assert tc.moe_shared_expert_intermediate_size is None and tc.moe_expert_capacity_factor is None
    assert not tc.moe_grouped_gemm  # no transformer-engine on this machine


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_megatron_routing_equals_transformers(norm_topk_prob):
    """Megatron's top-k probabilities for the same logits are HF's routing weights."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = {k: v for k, v in tiny_config("qwen3-moe").items() if k not in ("architectures", "model_type")}
    cfg["norm_topk_prob"] = norm_topk_prob
    router = Qwen3MoeTopKRouter(Qwen3MoeConfig(**cfg))
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
    x = torch.randn(32, cfg["hidden_size"])
    logits, weights, indices = router(x)
    spec = spec_from_hf_config({**tiny_config("qwen3-moe"), "norm_topk_prob": norm_topk_prob})
    tc = transformer_config_from_spec(spec)
    probs, routing_map = topk_routing_with_score_function(
        logits, tc.moe_router_topk, use_pre_softmax=tc.moe_router_pre_softmax,
        score_function=tc.moe_router_score_function)[:2]
    want = torch.zeros_like(probs).scatter(1, indices, weights)
    assert torch.equal(routing_map, want > 0)
    torch.testing.assert_close(probs, want, rtol=0, atol=1e-6)  # fp32 softmax in two op orders


def test_roundtrip_bf16_bit_exact_and_layout(tmp_path):
    hf, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    save_tiny_hf_model(hf, "qwen3-moe")
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back]) == 0
    _assert_bit_exact(hf, back)
    tensors = CheckpointReader(ckpt).tensors()
    # (layers, global experts, rows, cols): the keys megatron-core's SequentialMLP shards.
    assert tuple(tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"].size) == (4, 4, 2 * 32, 64)
    assert tuple(tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"].size) == (4, 4, 64, 32)
    assert tuple(tensors["decoder.layers.mlp.router.weight"].size) == (4, 4, 64)
    assert tuple(tensors["decoder.layers.pre_mlp_layernorm.weight"].size) == (4, 64)
    with open(os.path.join(back, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3MoeForCausalLM"]


@pytest.mark.parametrize("change, match", [
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size 64"),
    ({"moe_intermediate_size": "32"}, "'moe_intermediate_size' must be a positive integer"),
    ({"num_experts": None, "num_local_experts": None}, "'num_experts'"),
])
def test_conversion_refuses_bad_moe_configs(tmp_path, capsys, change, match):
    hf = str(tmp_path / "hf")
    save_tiny_hf_model(hf, "qwen3-moe")
    with open(os.path.join(hf, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(change)
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")]) == 2
    assert match.replace("\\", "") in capsys.readouterr().err or pytest.fail(match)
    assert not os.path.exists(tmp_path / "out")
