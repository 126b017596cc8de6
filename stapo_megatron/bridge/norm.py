"""The local spec's norm with sequence parallelism (GPUs without transformer-engine or apex).

Megatron's local spec builds its norms with ``WrappedTorchNorm``, which refuses
``config.sequence_parallel`` ("sequence parallel not supported by torch LayerNorm"), so a paper
recipe (sequence parallelism whenever TP > 1) could not start on a GPU without transformer-engine.
A norm acts on each token alone, so under sequence parallelism it needs no communication in the
forward; only its weight's gradient is partial (each TP rank saw its own slice of the sequence)
and must be summed over TP. Megatron's ``finalize_model_grads`` does exactly that for every
parameter marked ``sequence_parallel`` (``_allreduce_non_tensor_model_parallel_grads``), the mark
that transformer-engine's and apex's norms put on theirs; `TorchNorm` is ``WrappedTorchNorm``
with that mark instead of the refusal. The module it returns is the same ``torch.nn.RMSNorm`` /
``LayerNorm``, so parameter names and checkpoints do not change.
"""

from __future__ import annotations

import torch


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm whose weight w is stored zero-centred and applied as (1 + w), in fp32 and rounded
    once to the input dtype (HF ``Qwen3_5RMSNorm``; megatron-core's ``layernorm_zero_centered_gamma``
    with transformer-engine). The parameter is ``weight``, so checkpoint keys do not change."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class PlainRMSNorm:
    """`TorchNorm`'s RMSNorm with its weight applied as it is, whatever the config's
    ``layernorm_zero_centered_gamma``: the gated delta net's output norm (HF ``Qwen3_5RMSNormGated``
    stores a plain weight while the model's other norms are zero-centred)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


class TorchNorm:
    """``WrappedTorchNorm`` that supports sequence parallelism (module docstring), and
    zero-centred RMSNorm weights (`ZeroCenteredRMSNorm`)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        unsupported = [name for name in ("persist_layer_norm", "memory_efficient_layer_norm")
                       if getattr(config, name, False)]
        if config.layernorm_zero_centered_gamma and config.normalization != "RMSNorm":
            unsupported.append("layernorm_zero_centered_gamma with LayerNorm")
        if unsupported:
            raise ValueError(f"the local spec's torch norm does not support {', '.join(unsupported)}")
        if config.layernorm_zero_centered_gamma:
            norm = ZeroCenteredRMSNorm(hidden_size, eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization must be RMSNorm or LayerNorm, got {config.normalization!r}")
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def use_torch_norm(layer) -> None:
    """Replace ``WrappedTorchNorm`` by `TorchNorm` in a local layer spec (in place): the input and
    pre-MLP norms and the q/k norms. Apex's ``FusedLayerNorm`` (where installed) is left alone:
    it supports sequence parallelism itself."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    attention = layer.submodules.self_attention.submodules
    for owner, name in ((layer.submodules, "input_layernorm"), (layer.submodules, "pre_mlp_layernorm"),
                        (attention, "q_layernorm"), (attention, "k_layernorm")):
        if getattr(owner, name, None) is WrappedTorchNorm:
            setattr(owner, name, TorchNorm)


def final_norm():
    """The norm class for the block's final norm: `TorchNorm` where Megatron would use
    ``WrappedTorchNorm``, else Megatron's own choice (apex's ``FusedLayerNorm``)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return TorchNorm if transformer_block.LayerNormImpl is WrappedTorchNorm else transformer_block.LayerNormImpl
