"""Tier a: the fused-kernel switches chosen per device and kernel availability, and RoPE numerics.

`bridge.kernels.fused_kernel_settings` is a function of facts (CUDA or not, TE spec or not,
which kernel modules import), so its choice for a GPU machine can be shown here. RoPE: with
``apply_rope_fusion`` off, Megatron rotates q/k as transformers and vLLM do (in bf16); TE's
fused kernel would rotate in fp32 and round once, which is what the last check tells apart.
"""


import pytest
import torch
import torch.distributed as dist

from stapo_megatron.bridge import spec_from_hf_config
from stapo_megatron.bridge.kernels import fused_kernel_settings
from stapo_megatron.bridge.transformer_config import transformer_config_from_spec
from stapo_megatron.bridge.tiny import tiny_config
from tests.helpers.dist_utils import single_process_env

ROPE_THETA, HEAD_DIM, SEQ, HEADS = 1e6, 128, 64, 4


def _modules(*names):
    return lambda name: name in names


@pytest.mark.parametrize("cuda, use_te, present, expected_on", [
    # the CPU: every fused kernel is CUDA-only, whatever imports
    (False, False, ("triton",), set()),
    (False, True, ("triton", "transformer_engine"), set()),
    # a plain pip GPU install without Triton: nothing to fuse with
    (True, False, (), set()),
    # a GPU with Triton (every torch CUDA wheel): torch.compile'd bias-dropout and SwiGLU
    (True, False, ("triton",), {"bias_dropout_fusion", "bias_activation_fusion"}),
    # with TE: the same plus TE's persistent norm; RoPE fusion stays off (fp32 rotation)
    (True, True, ("triton", "transformer_engine"), {"bias_dropout_fusion", "bias_activation_fusion",
                                                    "persist_layer_norm"}),
    # apex's compiled softmax kernels
    (True, False, ("triton", "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
     {"bias_dropout_fusion", "bias_activation_fusion", "masked_softmax_fusion"}),
])
def test_fusions_follow_device_and_kernels(cuda, use_te, present, expected_on):
    settings = fused_kernel_settings(use_te, cuda=cuda, has_module=_modules(*present))
    assert {name for name, on in settings.items() if on} == expected_on
    assert settings["apply_rope_fusion"] is False and settings["gradient_accumulation_fusion"] is False


def test_swiglu_fusion_is_a_valid_config_for_qwen():
    """megatron-core accepts bias_activation_fusion for Qwen's MLP (silu, gated, no bias): its
    fused path is ``bias_swiglu_impl`` with bias None."""
    gpu = fused_kernel_settings(use_te=False, cuda=True, has_module=_modules("triton"))
    config = transformer_config_from_spec(spec_from_hf_config(tiny_config("qwen3")), use_te=False, **gpu)
    assert config.bias_activation_fusion and config.gated_linear_unit and not config.add_bias_linear
    assert config.activation_func is torch.nn.functional.silu and not config.apply_rope_fusion


def test_unfused_rope_equals_transformers_and_vllm_in_bf16():
    """Bit for bit: Megatron's RoPE with apply_rope_fusion=False, transformers' Qwen3 RoPE and
    vLLM's (forward_native: the same arithmetic as its CUDA kernel, per-op bf16) on bf16 q; a
    rotation in fp32 rounded once (TE's fused kernel) differs from them."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as megatron_rope
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer import TransformerConfig
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from stapo_megatron.mcore import cpu_compat

    cpu_compat.apply()
    q_SHD = (3 * torch.randn(SEQ, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(0))).bfloat16()
    positions = torch.arange(SEQ)
    # transformers: [B, H, S, D]
    hf_config = Qwen3Config(head_dim=HEAD_DIM, rope_theta=ROPE_THETA, hidden_size=512, num_attention_heads=HEADS)
    q_BHSD = q_SHD.permute(1, 0, 2)[None]
    cos, sin = Qwen3RotaryEmbedding(hf_config)(q_BHSD, positions[None])
    hf_SHD = apply_rotary_pos_emb(q_BHSD, q_BHSD, cos, sin)[0][0].permute(1, 0, 2)
    # vLLM: [T, H * D], neox style (Qwen)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(HEAD_DIM, 4096, True, {"rope_theta": ROPE_THETA, "rope_type": "default"}, torch.bfloat16)
    flat = q_SHD.reshape(SEQ, HEADS * HEAD_DIM)
    vllm_SHD = rope.forward_native(positions, flat.clone(), flat.clone())[0].reshape(SEQ, HEADS, HEAD_DIM)
    # Megatron: [S, B, H, D], as the attention layer calls it (one-rank CP group)
    freqs = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=1.0, rotary_base=ROPE_THETA,
                            use_cpu_initialization=True).get_emb(SEQ)
    config = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=HEADS, apply_rope_fusion=False)
    # a one-rank CP group; no earlier test leaves a default group behind (conftest's guard)
    with single_process_env():
        dist.init_process_group("gloo")
        try:
            megatron_SHD = megatron_rope(q_SHD[:, None], freqs, config=config, cp_group=dist.group.WORLD)[:, 0]
        finally:
            dist.destroy_process_group()
    assert torch.equal(megatron_SHD, hf_SHD) and torch.equal(vllm_SHD, hf_SHD)
    # TE's fused RoPE: the rotation in fp32, one rounding (many elements differ by one ulp)
    cos_SD, sin_SD = freqs.cos()[:, 0], freqs.sin()[:, 0]
    q = q_SHD.float()
    fused_SHD = (q * cos_SD + torch.cat([-q[..., HEAD_DIM // 2:], q[..., :HEAD_DIM // 2]], -1) * sin_SD).bfloat16()
    assert (fused_SHD != hf_SHD).float().mean() > 0.05
