"""Tiny GPTModels with LoRA adapters for the LoRA tests (`stapo_megatron.mcore.lora`): the model,
full-size adapter weights drawn per adapter, the merged reference and a forward on fixed tokens."""

from __future__ import annotations

import zlib

import torch

VOCAB, SEQ, BATCH = 128, 16, 2
"""The tiny model's (padded) vocabulary and the fixed batch: SEQ divisible by TP = 2 (sequence parallelism)."""


def tiny_gpt(tp: int = 1, sequence_parallel: bool = False, seed: int = 1234, **fields):
    """The tiny Qwen3 GPTModel (`bridge.tiny.tiny_qwen3_spec` with ``fields``; the local spec with
    its sequence-parallel torch norms, fp32) for this rank's TP position, its weights drawn from
    ``seed``; needs the parallel state."""
    from megatron.core import tensor_parallel

    from stapo_megatron.bridge.model import build_gpt_model
    from stapo_megatron.bridge.tiny import tiny_qwen3_spec

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    extra = dict(sequence_parallel=True) if sequence_parallel else {}
    return build_gpt_model(tiny_qwen3_spec(vocab_size=VOCAB, **fields), make_vocab_size_divisible_by=1,
                           use_te=False, calculate_per_token_loss=True, use_cpu_initialization=True, **extra)


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


def seven_reward(response: str, answer: str):
    """A reward that an untrained character-level model earns now and then (1.0 when the response
    holds a "7", else 0.0): mixed rewards in every group, so a few RL steps train the adapters."""
    from stapo_megatron.rewards.answers import STATUS_OK

    return (1.0 if "7" in response else 0.0), STATUS_OK
