"""Tiny GPTModels with LoRA adapters for the LoRA tests (`stapo_megatron.mcore.lora`): the model,
full-size adapter weights drawn per adapter, the merged reference and a forward on fixed tokens."""

from __future__ import annotations

import zlib

import torch

VOCAB, SEQ, BATCH = 128, 16, 2
"""The tiny model's (padded) vocabulary and the fixed batch: SEQ divisible by TP = 2 (sequence parallelism)."""


def tiny_gpt(tp: int = 1, sequence_parallel: bool = False, seed: int = 1234, **fields):
    """The tiny Qwen3 GPTModel (`bridge.tiny.tiny_qwen3_spec` with ``fields``; Megatron's local
    spec, fp32, CPU kernels) for this rank's TP position; needs the parallel state."""
    from stapo_megatron.bridge.kernels import fused_kernel_settings
    from stapo_megatron.bridge.tiny import tiny_qwen3_spec
    from stapo_megatron.bridge.transformer_config import transformer_config_from_spec
    from stapo_megatron.recipes.synthetic import build_tiny_gpt

    spec = tiny_qwen3_spec(**fields)
    extra = dict(sequence_parallel=True) if sequence_parallel else {}
    config = transformer_config_from_spec(spec, tp, 1, use_te=False, use_cpu_initialization=True,
                                          calculate_per_token_loss=True,
                                          **fused_kernel_settings(use_te=False, cuda=False), **extra)
    return build_tiny_gpt(config, VOCAB, SEQ, seed=seed)


def tokens() -> torch.Tensor:
    """The fixed batch [BATCH, SEQ] of token ids."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def forward(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """The model's logits [B, S, V (or V/TP)] for ``tokens_BS`` (causal, no padding)."""
    b, s = tokens_BS.shape
    return model(tokens_BS, torch.arange(s).unsqueeze(0).expand(b, s), attention_mask=None)


def full_adapter_weights(name: str, shapes, scale_a: float = 0.3, scale_b: float = 0.3):
    """Full-size (A, B) for the adapter of base linear ``name`` (``shapes``: its ``full_shapes``),
    the same on every rank and layout: the hand-set values of a trained adapter."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    a = torch.randn(shapes[0], generator=gen) * scale_a
    b = torch.randn(shapes[1], generator=gen) * scale_b
    return a, b


def merged_copy(lora_model, plain_model):
    """``plain_model`` (a same-architecture model without adapters) given ``lora_model``'s base
    weights with each adapter merged in: W = W0 + (alpha / r) B A (TP = 1)."""
    from stapo_megatron.mcore.lora import lora_adapters

    base = {k: v for k, v in lora_model.state_dict().items() if ".lora." not in k}
    plain_model.load_state_dict(base)
    with torch.no_grad():
        for name, adapter in lora_adapters(lora_model).items():
            weight = plain_model.get_submodule(name).weight
            weight += adapter.scaling * adapter.B.double() @ adapter.A.double()
    return plain_model
