"""`QwenSpec` -> Megatron ``TransformerConfig``: the architecture, the parallel sizes it can be split
at, the padded vocabulary and the MoE router settings.

MoE routing equivalence (HF ``Qwen3MoeTopKRouter`` vs Megatron ``topk_softmax_with_capacity``):
HF takes softmax over all expert logits, keeps the top k and, with ``norm_topk_prob``, divides
them by their sum. Renormalised top-k softmax probabilities equal a softmax over the top-k
logits, which is Megatron's ``moe_router_pre_softmax=False``; without renormalisation HF's
weights are the raw top-k of the full softmax, Megatron's ``moe_router_pre_softmax=True``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from stapo_megatron.bridge.hf_config import QwenSpec
from stapo_megatron.bridge.hybrid_config import check_hybrid_parallel
from stapo_megatron.bridge.kernels import fused_kernel_settings, use_transformer_engine

DEFAULT_VOCAB_DIVISOR = 128
"""Megatron's ``make_vocab_size_divisible_by`` default; the padded vocabulary is a multiple of
this times the TP size so every TP shard of the embedding has the same number of rows."""


def check_parallel_sizes(spec: QwenSpec, tensor_model_parallel_size: int, pipeline_model_parallel_size: int = 1,
                         expert_model_parallel_size: int = 1, expert_tensor_parallel_size: Optional[int] = None) -> None:
    """Raise ValueError unless the model can be split at this TP/PP (and, for MoE, EP/expert-TP)
    size. ``expert_tensor_parallel_size`` None means equal to TP (megatron-core's default)."""
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    checks = [(tp, "tensor_model_parallel_size", "num_attention_heads", spec.num_attention_heads),
              (tp, "tensor_model_parallel_size", "num_query_groups (num_key_value_heads)", spec.num_query_groups)]
    if spec.is_moe:
        checks += [(ep, "expert_model_parallel_size", "num_moe_experts (num_experts)", spec.num_moe_experts),
                   (etp, "expert_tensor_parallel_size", "moe_ffn_hidden_size (moe_intermediate_size)",
                    spec.moe_ffn_hidden_size)]
    else:
        checks.append((tp, "tensor_model_parallel_size", "ffn_hidden_size (intermediate_size)", spec.ffn_hidden_size))
        if ep != 1:
            raise ValueError(f"expert_model_parallel_size {ep} needs a MoE model; {spec.architecture} is dense")
    checks += check_hybrid_parallel(spec, tp)
    for size, size_name, name, value in checks:
        if value % size:
            raise ValueError(f"{size_name} {size} does not divide {name} {value}")
    if spec.num_layers % pp:
        raise ValueError(f"pipeline_model_parallel_size {pp} does not divide num_layers {spec.num_layers}")


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int = 1,
                      make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Megatron's padded vocabulary: the next multiple of divisor x TP."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def moe_settings(spec: QwenSpec, use_te: bool) -> dict:
    """TransformerConfig's MoE fields for a Qwen3-MoE spec (Megatron-Bridge's Qwen3 MoE provider
    uses the same router settings).

    Routing: see the module docstring (``moe_router_pre_softmax = not norm_topk_prob``).
    Aux loss: megatron-core's per-layer switch load-balancing loss with HF's coefficient. It is
    HF's ``load_balancing_loss_func`` of that layer divided by top-k (Megatron normalises the
    expert counts by tokens x top-k, HF by tokens); HF pools all layers into one loss and adds
    it only with ``output_router_logits=True``. Dispatcher: "alltoall" (all_to_all_single,
    which gloo implements with uneven splits; the "allgather" dispatcher reduce-scatters, which
    gloo does not). Grouped GEMM: transformer-engine's grouped linear, only with the TE spec.
    """
    return dict(
        num_moe_experts=spec.num_moe_experts,
        moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not spec.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=spec.moe_aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=use_te,
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=spec.moe_shared_expert_intermediate_size is not None,
        moe_router_enable_expert_bias=False,
        moe_expert_capacity_factor=None,  # dropless, as HF
    )


def transformer_config_from_spec(
    spec: QwenSpec,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_te: Optional[bool] = None,
    **overrides: Any,
):
    """The Megatron TransformerConfig that computes exactly what transformers computes.

    ``use_te``: whether the model uses the transformer-engine layer spec (None = auto, see
    `use_transformer_engine`); it decides which fused kernels are switched on.
    ``overrides`` are passed to TransformerConfig last (e.g. recompute or sequence-parallel
    settings of a training recipe); they must not change the architecture.
    For a MoE spec the expert-parallel sizes come in ``overrides``
    (``expert_model_parallel_size``, ``expert_tensor_parallel_size``) and are checked here.
    """
    from megatron.core.transformer import TransformerConfig

    check_parallel_sizes(spec, tensor_model_parallel_size, pipeline_model_parallel_size,
                         overrides.get("expert_model_parallel_size", 1), overrides.get("expert_tensor_parallel_size"))
    on_gpu = torch.cuda.is_available()
    use_te = use_transformer_engine(use_te)
    kwargs = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.kv_channels,
        layernorm_epsilon=spec.layernorm_epsilon,
        add_qkv_bias=spec.add_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        init_method_std=spec.init_method_std,
        normalization="RMSNorm",
        gated_linear_unit=True,  # SwiGLU: linear_fc1 = [gate; up]
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        **fused_kernel_settings(use_te),
    )
    if spec.is_moe:
        kwargs.update(moe_settings(spec, use_te))
    from stapo_megatron.bridge.hybrid import hybrid_settings

    kwargs.update(hybrid_settings(spec))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)
