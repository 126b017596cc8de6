"""Build a Megatron GPTModel for an HF Qwen config, and load a dist checkpoint into it.

`build_gpt_model` is the single place that turns an HF Qwen config into a Megatron
`TransformerConfig` + `GPTModel`; the trainer, the converter's verifier and the rollout weight
sync all use it. Megatron's parallel state must be initialised first
(`stapo_megatron.mcore.parallel.init_parallel`).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, List, Optional, Union

import torch

from stapo_megatron.mcore import cpu_compat
from stapo_megatron.mcore.mcore_versions import define_missing_te_names
from stapo_megatron.bridge.hf_config import QwenSpec, spec_from_hf_config
from stapo_megatron.bridge.kernels import use_transformer_engine
from stapo_megatron.bridge.transformer_config import (DEFAULT_VOCAB_DIVISOR, padded_vocab_size,
                                                       transformer_config_from_spec)
from stapo_megatron.bridge.norm import final_norm, use_torch_norm


CORE_ATTENTIONS = ("local", "sdpa")
"""Core-attention modules of the local spec: Megatron's DotProductAttention ("local", which
materialises the s x s scores) or `stapo_megatron.bridge.attention.SDPAttention` ("sdpa")."""


def default_core_attention() -> str:
    """"sdpa" on CUDA (flash / cuDNN kernels), "local" on CPU (the reference path)."""
    return "sdpa" if torch.cuda.is_available() else "local"


def layer_spec(spec: QwenSpec, use_te: Optional[bool] = None, core_attention: Optional[str] = None):
    """Megatron layer spec: transformer-engine when it imports and CUDA is present, else local.

    Both spellings write the same dist-checkpoint keys (the local spec remaps its layernorm
    names), so a checkpoint is interchangeable between them. ``core_attention`` picks the
    local spec's attention kernel (CORE_ATTENTIONS; None = `default_core_attention`); the TE
    spec always uses TE's own.

    MoE (``spec.is_moe``): every layer's MLP is Megatron's MoELayer (router + experts), with
    transformer-engine's grouped-GEMM experts under the TE spec and ``SequentialMLP`` (one
    ColumnParallel/RowParallel MLP per local expert, runs on the CPU) under the local spec. The
    MoE layer has its own pre-MLP norm in both specs; its checkpoint key is the TE spelling
    ``pre_mlp_layernorm.weight`` (the local spec's key map would file it under
    ``mlp.linear_fc1.layer_norm_weight``, a name the TE MoE layer does not have).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    num_experts = spec.num_moe_experts
    if use_transformer_engine(use_te):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=spec.is_moe, qk_layernorm=spec.qk_layernorm)
    layer = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                                     qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    if spec.is_moe:
        layer.submodules.sharded_state_dict_keys_map = {
            k: v for k, v in layer.submodules.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."}
    use_torch_norm(layer)  # sequence parallelism without transformer-engine (bridge/norm.py)
    core_attention = core_attention or default_core_attention()
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention must be one of {CORE_ATTENTIONS}, got {core_attention!r}")
    if core_attention == "sdpa":
        from stapo_megatron.bridge.attention import SDPAttention

        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return layer


def block_spec(layer, config, use_te: bool, vp_stage: Optional[int] = None):
    """The decoder block of this pipeline stage: ``layer`` repeated, and for the local spec the
    final norm from `bridge.norm` (what Megatron builds from a bare layer spec, except that its
    ``WrappedTorchNorm`` refuses sequence parallelism). The transformer-engine spec is returned
    as it is."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if use_te:
        return layer
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=final_norm())


def _check_moe_context_parallel(cp: int, config_overrides: dict) -> None:
    """MoE with CP is exact for megatron-core's micro-batch switch loss (``aux_loss``; its counts
    are reduced over TP x CP, and `stapo_megatron.mcore.moe` weights it over the whole row).
    Refused: router settings whose statistics stay per CP rank's chunks (a per-sequence or
    global-batch balance loss, per-rank expert capacity) or whose weight the fix does not set (z-loss)."""
    balance = config_overrides.get("moe_router_load_balancing_type", "aux_loss")
    if balance not in ("aux_loss", "none"):
        raise ValueError(f"moe_router_load_balancing_type={balance!r} with context_parallel_size {cp}: only "
                         f"'aux_loss' (the micro-batch switch loss) is exact under context parallelism")
    if config_overrides.get("moe_z_loss_coeff"):
        raise ValueError(f"moe_z_loss_coeff={config_overrides['moe_z_loss_coeff']} with context_parallel_size {cp}: "
                         f"the router z-loss's weight is not set by stapo_megatron.mcore.moe; use 0")
    if config_overrides.get("moe_expert_capacity_factor") is not None:
        raise ValueError(f"moe_expert_capacity_factor={config_overrides['moe_expert_capacity_factor']} with "
                         f"context_parallel_size {cp}: capacity would count one CP rank's chunks; use None (dropless)")


def build_gpt_model(
    hf_config: Union[QwenSpec, dict, Any],
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
    parallel_output: bool = True,
    use_te: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    core_attention: Optional[str] = None,
    **config_overrides: Any,
):
    """A GPTModel for this rank's TP/PP position that computes what transformers computes.

    Args:
        hf_config: an HF config (dict from config.json, or PretrainedConfig) or a `QwenSpec`.
        params_dtype: parameter dtype (fp32 for parity checks, bf16 for training).
        make_vocab_size_divisible_by: vocabulary padding divisor (times TP).
        parallel_output: keep logits vocab-sharded over TP (True for the STAPO loss);
            False gathers them on every TP rank.
        use_te: force (True) or forbid (False) the transformer-engine spec; None = auto.
        vp_stage: virtual pipeline stage, for interleaved schedules.
        core_attention: the local spec's core attention, "local" or "sdpa" (None: "sdpa" on
            CUDA, "local" on CPU); ignored by the transformer-engine spec.
        config_overrides: extra TransformerConfig fields (training settings, not architecture).
    Returns:
        megatron.core.models.gpt.GPTModel; ``model.padded_vocab_size`` and ``model.qwen_spec``
        are set for callers that cut logits back to the real vocabulary.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    cpu_compat.apply()
    spec = hf_config if isinstance(hf_config, QwenSpec) else spec_from_hf_config(hf_config)
    if spec.is_moe:
        define_missing_te_names()
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    if spec.is_hybrid and use_te:
        raise ValueError(f"use_te=True: {spec.architecture} (delta-net layers) is built on the local spec only")
    use_te = False if spec.is_hybrid else use_transformer_engine(use_te)
    cp = ps.get_context_parallel_world_size()
    if cp > 1:  # the split itself is the caller's (batch.context_parallel); attention and RoPE read this
        config_overrides.setdefault("context_parallel_size", cp)
    if config_overrides.get("moe_enable_routing_replay") and not spec.is_moe:
        raise ValueError(f"moe_enable_routing_replay=True (rollout.routing_replay) needs a mixture-of-experts "
                         f"model; {spec.architecture} is dense (no router to replay)")
    if config_overrides.get("moe_enable_routing_replay") and config_overrides.get("moe_router_fusion"):
        # megatron-core's fused top-k (TE) returns before its replay hook: the replay would be ignored
        raise ValueError("moe_router_fusion=True with moe_enable_routing_replay=True (rollout.routing_replay): "
                         "the fused router ignores the replayed routes; turn one of them off")
    if spec.is_moe and cp > 1:
        _check_moe_context_parallel(cp, config_overrides)
    if spec.is_hybrid:  # before TransformerConfig, whose own check (0.16) names no field or version
        from stapo_megatron.bridge.hybrid import check_delta_net_layout

        check_delta_net_layout(spec, config_overrides.get("context_parallel_size", 1), tp)
    if spec.is_moe:
        # The expert layout is the one the parallel state was built with (init_parallel).
        config_overrides = {"expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
                            "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size(),
                            **config_overrides}
    config = transformer_config_from_spec(spec, tp, pp, params_dtype, use_te=use_te, **config_overrides)
    vocab = padded_vocab_size(spec.vocab_size, tp, make_vocab_size_divisible_by)
    if spec.is_hybrid:  # Qwen3.5: delta-net and full-attention layers (bridge/hybrid.py)
        from stapo_megatron.bridge.hybrid import hybrid_block_spec

        block = hybrid_block_spec(spec, layer_spec(spec, use_te, core_attention), config, vp_stage)
    else:
        block = block_spec(layer_spec(spec, use_te, core_attention), config, use_te, vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=vocab,
        max_sequence_length=spec.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=spec.rotary_percent,
        rotary_base=spec.rotary_base,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    model.padded_vocab_size = vocab
    model.qwen_spec = spec
    return model


DDP_PREFIX = "module."
"""Key prefix of a model saved through Megatron's DistributedDataParallel wrapper (what
`stapo_megatron.mcore.checkpoint.save_checkpoint` writes); converted and Megatron-LM checkpoints have none."""


def _with_ddp_keys(model):
    """``model`` as the ``module`` child of a bare MegatronModule, so that its sharded state dict
    and state dict carry the ``module.`` prefix a checkpoint saved through Megatron DDP has."""
    from megatron.core.transformer.module import MegatronModule

    wrapper = MegatronModule(config=model.config)
    wrapper.module = model
    return wrapper


_EXTRA_STATE = re.compile(r"_extra_state\d*$")


def extra_state_keys(keys: Iterable[str]) -> List[str]:
    """The `_extra_state` entries among a model's sharded-state-dict keys: ``..._extra_state`` of
    every linear and, for transformer-engine's grouped linears (TEGroupedMLP), one per GEMM after
    the first, ``..._extra_state1`` .. ``..._extra_state{N-1}`` (megatron-core
    ``extensions/transformer_engine.py``, ``TEGroupedLinear._sharded_state_dict_grouped``, 0.16 -
    0.19). Those hold fp8 scaling metadata, never weights."""
    return [k for k in keys if _EXTRA_STATE.search(k)]


def load_checkpoint(model, checkpoint_dir: str) -> None:
    """Load a Megatron dist checkpoint (from `stapo-convert hf-to-mcore` or the trainer).

    Works at any TP/PP: dist_checkpointing reads the overlap of each local shard. The
    embedding/output rows are zero-filled first and only the stored vocabulary rows are read,
    because the padded vocabulary depends on TP (allow_shape_mismatch in megatron-core).
    Entries of the checkpoint that the model does not have (optimizer state) are ignored.
    A trainer checkpoint stores the model under Megatron DDP's ``module.`` prefix; it is read
    into the bare model all the same. The checkpoint's ``.metadata`` is read without running
    code first (`stapo_megatron.mcore.checkpoint.read_dcp_metadata`), so a crafted file is refused.
    """
    from megatron.core import dist_checkpointing

    from stapo_megatron.mcore.checkpoint import read_dcp_metadata

    stored = read_dcp_metadata(checkpoint_dir).state_dict_metadata
    probe = "embedding.word_embeddings.weight"
    if DDP_PREFIX + probe in stored and not any(k.startswith(DDP_PREFIX) for k in model.state_dict()):
        model = _with_ddp_keys(model)
    sharded = model.sharded_state_dict()
    # Linear modules carry `_extra_state`: empty for the local spec, fp8 scaling metadata for
    # transformer-engine. Neither holds weights, and a checkpoint written under one spec has
    # the other's form, so they are not loaded (which lets either spec read any checkpoint).
    # TEGroupedMLP's per-GEMM ones too: read, they would take the converter's (local-spec) empty
    # objects, which only megatron-core's merge hook then drops
    for key in extra_state_keys(sharded):
        del sharded[key]
    state = dist_checkpointing.load(sharded, checkpoint_dir)
    missing, _ = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir} did not provide {missing}")
