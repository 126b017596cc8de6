"""Which fused kernels and layer spec this machine can run: transformer-engine or the local spec,
and TransformerConfig's fusion switches, each on only where its kernel imports."""

from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def use_transformer_engine(requested: Optional[bool] = None) -> bool:
    """Whether the transformer-engine layer spec is used: ``requested`` if given, else when
    CUDA is present and transformer_engine imports."""
    if requested is not None:
        return requested
    return torch.cuda.is_available() and _imports("transformer_engine")


def fused_kernel_settings(use_te: bool, cuda: Optional[bool] = None,
                          has_module: Callable[[str], bool] = _imports) -> dict:
    """TransformerConfig's fusion switches, each on only where its kernel exists.

    A plain pip install on a GPU has neither transformer-engine nor apex; megatron-core then
    fails at the first forward if a fusion is requested whose kernel is missing
    (megatron-core 0.16-0.19: ``persist_layer_norm`` asserts in the local spec's torch norm,
    ``masked_softmax_fusion`` imports apex's ``scaled_masked_softmax_cuda``).

    Args:
        use_te: whether the model uses the transformer-engine layer spec.
        cuda: whether the model runs on CUDA (None: ``torch.cuda.is_available()``).
        has_module: whether a module imports (the kernels' availability; a parameter so that
            the choice can be shown for machines other than this one).
    """
    if cuda is None:
        cuda = torch.cuda.is_available()
    if not cuda:
        # The CPU path: every fused kernel is CUDA-only.
        return dict(bias_dropout_fusion=False, bias_activation_fusion=False, apply_rope_fusion=False,
                    masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    triton = has_module("triton")
    return dict(
        # torch.compile'd (megatron.core.jit.jit_fuser) functions: need Triton, not apex or TE
        bias_dropout_fusion=triton,
        # SwiGLU in one kernel forward and backward (fusions/fused_bias_swiglu.py, bias or not):
        # the MLP of both the local and the TE spec, with the same silu(gate) * up as unfused
        bias_activation_fusion=triton,
        # Off even with TE: TE's fused RoPE rotates q/k in fp32 and rounds once, while HF,
        # vLLM (its CUDA kernel and forward_native) and Megatron's unfused path rotate in the
        # activation dtype (cos/sin cast to bf16, then x cos + rotate_half(x) sin in bf16).
        # Fused, the trainer's q/k would differ from the rollout engine's by up to one bf16 ulp.
        apply_rope_fusion=False,
        # apex / Megatron's compiled softmax kernels (unused by TE's and the SDPA core attention)
        masked_softmax_fusion=has_module("scaled_masked_softmax_cuda")
        and has_module("scaled_upper_triang_masked_softmax_cuda"),
        # Needs apex's fused_weight_gradient_mlp_cuda and a param.main_grad on every backward
        # (Megatron DDP); build_gpt_model also serves forward/backward without DDP, so it stays off.
        gradient_accumulation_fusion=False,
        # The TE spec ignores it; the local spec's RMSNorm (torch) asserts it is off.
        persist_layer_norm=use_te,
    )
