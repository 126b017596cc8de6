"""Tier a: the delta-net layers in the memory and step-time models, counted by hand on the tiny
Qwen3.5 (hidden 64; layers 0-2 gated delta net, layer 3 gated full attention; 4 query / 2 KV heads
of 32; delta net: 2 key / 4 value heads of 16, conv kernel 4; SwiGLU 96; 300 tokens)."""

import math

import pytest

from stapo_megatron.bridge.hf_config import num_params, spec_from_hf_config
from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.recipes import delta_net, memory, paper, step_model

SPEC = spec_from_hf_config(tiny_config("qwen3.5"))
# delta-net widths: qk = 2 x 16 = 32, v = 4 x 16 = 64, conv channels = 2 qk + v = 128, 4 value heads
# full attention: q = 4 x 32 = 128 (and as many gate rows), kv = 2 x 32 = 64


def _layout(tp=1, **model):
    fields = dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    return memory.ParallelLayout(num_nodes=1, gpus_per_node=tp, vllm_tensor_parallel_size=tp,
                                 vllm_gpu_memory_utilization=0.5,
                                 model=ModelConfig(tensor_model_parallel_size=tp, **{**fields, **model}))


def test_layer_counts_and_parameters_by_hand():
    assert (delta_net.num_linear_layers(SPEC), delta_net.num_attention_layers(SPEC)) == (3, 1)
    # in_proj (qkv 128 + z 64 + b 4 + a 4 rows of 64), conv1d 128 x 4, A_log and dt_bias 4 each,
    # the gated norm 16, out_proj 64 x 64
    assert delta_net.delta_net_params(SPEC) == 64 * 200 + 512 + 8 + 16 + 4096 == 17432
    # q and gate 2 x 128, k and v 64 each, rows of 64; o 128 x 64; q/k norms 32 each
    assert delta_net.attention_mixer_params(SPEC) == 64 * 384 + 128 * 64 + 64 == 32832
    assert delta_net.mixer_params_difference(SPEC) == 17432 - 32832
    # a model without delta-net layers: nothing changes
    qwen3 = paper.ARCHITECTURES["qwen3_8b"]
    assert (delta_net.num_linear_layers(qwen3), delta_net.num_attention_layers(qwen3)) == (0, 36)
    assert delta_net.mixer_params_difference(qwen3) == 0 and delta_net.delta_rule_flops_per_token(qwen3) == 0


def test_params_per_gpu_count_the_delta_net_mixers():
    """4 layers of 51392 (gated attention 32768, SwiGLU 18432, norms 192), 3 of them with the
    delta-net mixer instead; untied 300-token tables padded to 384 rows; the final norm. The
    same layers as `num_params` (which test_hybrid_config holds to transformers' count)."""
    layers = 4 * 51392 - 3 * 15400
    assert memory.params_per_gpu(SPEC, _layout()) == layers + 2 * 384 * 64 + 64
    assert num_params(SPEC) == layers + 2 * 300 * 64 + 64


def test_vllm_state_and_kv_cache_by_hand():
    # K and V of the one full-attention layer: 2 x 64 channels x 2 bytes
    assert delta_net.kv_bytes_per_token(SPEC) == 256 and delta_net.kv_bytes_per_token(SPEC, 2) == 128
    # per sequence: 3 layers x 4 heads x 16 x 16 fp32 states, 3 layers x 128 channels x 3 bf16 conv inputs
    assert delta_net.recurrent_state_bytes(SPEC) == 3 * 4 * 256 * 4 == 12288
    assert delta_net.conv_state_bytes(SPEC) == 3 * 128 * 3 * 2 == 2304
    assert delta_net.state_bytes_per_sequence(SPEC, 2) == (12288 + 2304) / 2
    # 1e6 free bytes hold 1e6 / (100 x 256 + 14592) = 24.88 sequences of 100 tokens: 2488 tokens
    assert delta_net.kv_cache_tokens(SPEC, 1e6, 1, 100) == 2488
    # without delta-net layers: every byte is K and V (the Qwen3 count, unchanged)
    qwen3 = paper.ARCHITECTURES["qwen3_8b"]
    assert delta_net.kv_cache_tokens(qwen3, 1e9, 4, 16384) == int(1e9 / (2 * 36 * 1024 * 2 / 4))


def test_activations_by_hand():
    # delta-net mixer: 6 x 128 conv + 4 x 32 l2norm + 4 x 4 x 16 repeated q/k + (6 + 4 x 64) x 4 heads + 20 x 64
    assert delta_net.kept_mixer_bytes(SPEC, 1) == 768 + 128 + 256 + 1048 + 1280 == 3480
    assert delta_net.kept_mixer_bytes(SPEC, 2) == 3480 / 2
    # gated attention: 14 (q + kv) + 6 q for the output gate
    assert delta_net.attention_mixer_bytes(SPEC, _layout()) == 14 * 192 + 6 * 128 == 3456
    assert delta_net.kept_mixer_difference(SPEC, _layout()) == 3 * (3480 - 3456)
    # a layer: two norms' 10 h each, the mixer, SwiGLU 6 ffn
    assert memory.kept_layer_bytes(SPEC, _layout()) == 640 + 3456 + 640 + 576 == 5312
    tokens = 16384
    est = memory.memory_estimate(SPEC, _layout(), seq_len=tokens)
    assert est.activations == (5 * 5312 + 3 * (3480 - 3456)) * tokens
    # full recomputation rebuilds the larger mixer: gated attention's 2 q + 2 kv + q = 512, not the
    # delta net's 2 x 128 conv + 3 x 64 = 448
    assert delta_net.recompute_mixer_bytes(SPEC, 1) == 448
    full = memory.memory_estimate(SPEC, _layout(recompute_granularity="full", recompute_method="uniform",
                                                recompute_num_layers=1), seq_len=tokens)
    one_layer = 2 * (4 * 64 + max(512, 448) + 3 * 96)
    assert full.activations == 2 * 64 * tokens * 4 + 2 * one_layer * tokens


def test_flops_and_the_step_models_shapes_by_hand():
    # per value head 2 x 64 x (16 + 16) intra-chunk + 6 x 16 x 16 state; the conv 2 x 128 x 4; 3 layers
    assert delta_net.delta_rule_flops_per_token(SPEC) == 3 * (4 * (4096 + 1536) + 1024) == 70656
    model = step_model.model_spec(SPEC)
    assert (model.attn_layers, model.state_bytes, model.linear_flops) == (1, 14592, 70656)
    assert model.kv_bytes_per_token == 256  # the full-attention layer's only
    hw, eff = step_model.H100, step_model.Efficiency()
    tokens = [1000, 3000]
    # forward FLOPs: (2 N + the delta rule) a token, causal attention (4 x width a position pair) in 1 layer
    flops = (2 * num_params(SPEC) + 70656) * 4000 + 4 * 1 * 128 * (1000 ** 2 + 3000 ** 2) / 2
    per_gpu = 4000 / 8
    mfu = eff.forward_mfu * per_gpu / (per_gpu + eff.half_tokens)
    assert step_model.train_phase_s(model, hw, eff, tokens, 8, "forward") == pytest.approx(
        flops / (8 * hw.peak_tflops * 1e12 * mfu))
    # decode: a running sequence holds its states (57 KV tokens' worth) besides its next token
    dm = step_model.decode_model(model, hw, eff, tp=1, memory_share=0.5)
    assert dm.seq_tokens == 1 + math.ceil(14592 / 256) == 58
