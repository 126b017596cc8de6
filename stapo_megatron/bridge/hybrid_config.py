"""Qwen3.5's hybrid architecture facts: the config fields `hf_config.spec_from_hf_config` reads for
``Qwen3_5ForCausalLM`` beyond Qwen3's, their checks, and the delta-net layer's parameter count.

A Qwen3.5 text model interleaves gated delta-net (linear attention) layers with full-attention
layers in the pattern of ``layer_types`` (three of every four layers linear in the released
models). Full attention is Qwen3's with an output gate (q_proj also yields a per-head gate),
partial RoPE (``partial_rotary_factor``, 0.25) and zero-centred norms; MLPs are dense SwiGLU.

Megatron-core 0.16 to 0.19 express all of it: ``experimental_attention_variant="gated_delta_net"``
with the per-layer pattern as ``linear_attention_freq`` (a list, 1 = delta net),
``attention_output_gate``, ``rotary_percent`` and ``layernorm_zero_centered_gamma``.
The multimodal RoPE fields (``mrope_section``, ``mrope_interleaved``) are accepted: with text
only, the three position streams are equal and the rotation is plain RoPE.
"""

from __future__ import annotations

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
"""Qwen3.5 ``layer_types`` entries: a gated delta-net layer and a (gated) full-attention layer."""

_LINEAR_FIELDS = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_num_key_heads", "linear_num_value_heads")


def _layer_types(cfg: dict) -> tuple[str, ...]:
    """HF ``layer_types`` (or, without it, transformers' default from ``full_attention_interval``),
    each entry checked."""
    num_layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:  # transformers' Qwen3_5TextConfig default
        interval = int(cfg.get("full_attention_interval", 4))
        types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)]
    if not isinstance(types, (list, tuple)) or len(types) != num_layers:
        raise ValueError(f"layer_types must list one entry per layer (num_hidden_layers {num_layers}), "
                         f"got {types!r}")
    unknown = sorted({(i, t) for i, t in enumerate(types) if t not in (LINEAR_ATTENTION, FULL_ATTENTION)})
    if unknown:
        raise ValueError(f"layer_types entry {unknown[0][1]!r} (layer {unknown[0][0]}) is not mapped: the converter "
                         f"maps {LINEAR_ATTENTION!r} (gated delta net) and {FULL_ATTENTION!r} layers only")
    return tuple(types)


def qwen35_fields(cfg: dict) -> dict:
    """`QwenSpec`'s hybrid fields of a ``Qwen3_5ForCausalLM`` config; ValueError naming the field
    for a variant the Megatron model here would not reproduce."""
    for field in _LINEAR_FIELDS:
        value = cfg.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"field {field!r} must be a positive integer, got {value!r}")
    if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
        raise ValueError(f"linear_num_value_heads {cfg['linear_num_value_heads']} is not a multiple of "
                         f"linear_num_key_heads {cfg['linear_num_key_heads']}")
    params = cfg.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25)))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim % 2 or rotary_dim != head_dim * factor:
        raise ValueError(f"partial_rotary_factor {factor} x head_dim {head_dim} must be an even whole number of "
                         f"channels in (0, head_dim]")
    if int(cfg.get("mtp_num_hidden_layers") or 0) < 0:
        raise ValueError(f"mtp_num_hidden_layers must be >= 0, got {cfg['mtp_num_hidden_layers']}")
    return dict(layer_types=_layer_types(cfg), rotary_percent=factor, attention_output_gate=True,
                zero_centered_norm=True, mtp_num_layers=int(cfg.get("mtp_num_hidden_layers") or 0),
                **{f: int(cfg[f]) for f in _LINEAR_FIELDS})


def qwen35_moe_fields(cfg: dict) -> dict:
    """`QwenSpec`'s MoE fields of a ``Qwen3_5MoeForCausalLM`` config: routed experts in every layer
    and a gated shared expert. Its router always renormalises the top-k probabilities
    (transformers' ``Qwen3_5MoeTopKRouter`` has no ``norm_topk_prob`` switch)."""
    fields = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
    for field in fields:
        value = cfg.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"field {field!r} must be a positive integer, got {value!r}")
    if not cfg["num_experts_per_tok"] <= cfg["num_experts"]:
        raise ValueError(f"num_experts_per_tok {cfg['num_experts_per_tok']} must be in [1, num_experts "
                         f"{cfg['num_experts']}]")
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"mlp_only_layers {cfg.get('mlp_only_layers')} / decoder_sparse_step "
                         f"{cfg.get('decoder_sparse_step')}: only every layer a MoE layer is supported")
    return dict(num_moe_experts=cfg["num_experts"], moe_router_topk=cfg["num_experts_per_tok"],
                moe_ffn_hidden_size=cfg["moe_intermediate_size"], norm_topk_prob=True,
                moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.001)),
                moe_shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"])


def delta_net_dims(spec) -> dict:
    """Row counts of a delta-net layer's projections: ``qk`` (each of query and key,
    heads x key head size), ``v`` (value and the gate z), ``heads`` (value heads: rows of b and
    a, entries of A_log and dt_bias) and ``conv`` (channels of the convolution: q, k, v)."""
    qk = spec.linear_num_key_heads * spec.linear_key_head_dim
    v = spec.linear_num_value_heads * spec.linear_value_head_dim
    return dict(qk=qk, v=v, heads=spec.linear_num_value_heads, conv=2 * qk + v)


def delta_net_params(spec) -> int:
    """Parameters of one delta-net token mixer: in_proj (qkv, z, b, a), conv1d, A_log, dt_bias,
    the gated norm and out_proj."""
    d, h = delta_net_dims(spec), spec.hidden_size
    in_proj = h * (d["conv"] + d["v"] + 2 * d["heads"])
    return in_proj + d["conv"] * spec.linear_conv_kernel_dim + 2 * d["heads"] + spec.linear_value_head_dim + d["v"] * h


def check_hybrid_parallel(spec, tensor_model_parallel_size: int) -> list[tuple]:
    """(size, size name, field name, value) divisibility checks of the delta-net layers at this TP."""
    tp = tensor_model_parallel_size
    shared = ([(tp, "tensor_model_parallel_size", "moe_shared_expert_intermediate_size "
                "(shared_expert_intermediate_size)", spec.moe_shared_expert_intermediate_size)]
              if spec.moe_shared_expert_intermediate_size else [])
    if not spec.is_hybrid:
        return shared
    return shared + [(tp, "tensor_model_parallel_size", "linear_num_key_heads", spec.linear_num_key_heads),
            (tp, "tensor_model_parallel_size", "linear_num_value_heads", spec.linear_num_value_heads)]


def delta_net_layout_problems(spec, context_parallel_size: int, sequence_parallel: bool = False,
                              packed: bool = False, tensor_model_parallel_size: int = 1) -> list[str]:
    """What the delta-net layers of ``spec`` refuse of a parallel layout (empty for a model
    without them): context parallelism before megatron-core 0.19 (0.16 and 0.17's gated delta net
    has none, the bridge does not build on 0.18's; `mcore_versions.delta_net_has_context_parallel`),
    and from 0.19 a CP size that does not divide each TP rank's key and value heads (the
    all-to-all gives every CP rank 1 / CP of them); sequence parallelism with packed micro-batches
    (the packed delta-net layer of 0.16 and 0.17 runs each sequence on its own,
    `bridge.hybrid.packed_delta_net`, so a TP rank needs whole sequences; refused on every release
    alike, so a layout means the same on all)."""
    if not spec.is_hybrid:
        return []
    problems = []
    if context_parallel_size > 1:
        problems += _delta_net_cp_problems(spec, context_parallel_size, tensor_model_parallel_size)
    if packed and sequence_parallel:
        problems.append(f"model.sequence_parallel=True with packed micro-batches is not supported for "
                        f"{spec.architecture}: the packed delta-net layer is built without it (on megatron-core 0.16 "
                        f"and 0.17 it runs each sequence on its own, whole on every TP rank); set "
                        f"model.sequence_parallel=False or packing='padded'")
    return problems


def _delta_net_cp_problems(spec, cp: int, tp: int) -> list[str]:
    """`delta_net_layout_problems`' context-parallel part (``cp`` > 1): the installed
    megatron-core's release, then the heads per TP rank over CP."""
    from megatron.core import __version__  # here: the config tree imports this module without megatron

    from stapo_megatron.mcore.mcore_versions import DELTA_NET_CP_SINCE, delta_net_has_context_parallel

    if not delta_net_has_context_parallel():
        return [f"model.context_parallel_size {cp} is not supported for {spec.architecture} on megatron-core "
                f"{__version__}: its delta-net layers (layer_types has {len(spec.layers_of_type(LINEAR_ATTENTION))} "
                f"linear_attention layers) have context parallelism from megatron-core "
                f"{'.'.join(map(str, DELTA_NET_CP_SINCE))}; use model.context_parallel_size=1 or a newer megatron-core"]
    return [f"{field} {count} per tensor_model_parallel_size {tp} rank ({count // tp}) is not divisible by "
            f"model.context_parallel_size {cp} (the delta-net layers give each CP rank 1 / CP of a TP rank's heads)"
            for field, count in (("linear_num_key_heads", spec.linear_num_key_heads),
                                 ("linear_num_value_heads", spec.linear_num_value_heads))
            if count % tp == 0 and (count // tp) % cp]
