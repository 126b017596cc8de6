"""HF Qwen config -> architecture facts (`QwenSpec`): the one place that reads an HF ``config.json``.

Every field that changes the computation is mapped explicitly; Megatron's defaults are never
relied on because several differ from Qwen (layernorm eps 1e-5 vs 1e-6, rotary base 10000 vs 1e6,
dropout 0.1 vs 0). `bridge.transformer_config` turns a `QwenSpec` into Megatron's TransformerConfig.

Supported: ``Qwen2ForCausalLM`` (Qwen2, Qwen2.5: qkv bias, no q/k norm),
``Qwen3ForCausalLM`` (dense Qwen3: q/k RMSNorm, no bias, head_dim may differ from
hidden_size / num_attention_heads) and ``Qwen3MoeForCausalLM`` (Qwen3 attention, every MLP a
mixture of routed experts: softmax router, top-k, optional top-k renormalisation, no shared
expert), ``Qwen3_5ForCausalLM`` (the Qwen3.5 text model: gated delta-net linear-attention layers
and gated full-attention layers in the pattern of ``layer_types``, zero-centred RMSNorms, partial
RoPE; its MTP tensors are carried through the converter unchanged, see `bridge.mapping`). Tied and
untied embeddings; ``Qwen3_5MoeForCausalLM`` adds Qwen3-MoE's routed experts and a gated shared
expert to every layer. A spec's parameter counts (`num_params`, `num_active_params`)
are here too: the memory model and the converter's host-memory check both count them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any, Mapping, Optional, Union

from stapo_megatron.bridge.hybrid_config import (FULL_ATTENTION, LINEAR_ATTENTION,  # noqa: F401  (re-exported)
                                                 delta_net_params, qwen35_fields, qwen35_moe_fields)

SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3_5ForCausalLM",
                           "Qwen3_5MoeForCausalLM")
QWEN35_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
"""The Qwen3.5 text models (hybrid layers; `hybrid_config`)."""
"""HF ``architectures`` entries this bridge converts (Qwen2.5 checkpoints use Qwen2ForCausalLM)."""

VISION_LANGUAGE_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
"""Vision-language checkpoints: not a text model's config, so refused here by name (the model built
from a config is the text model; transformers' ``AutoModelForCausalLM`` drops the vision tower
``model.visual.*`` without a word). The converter takes their text tower through
`bridge.vision_language.text_config` and keeps the vision tower aside."""


@dataclasses.dataclass(frozen=True)
class QwenSpec:
    """Architecture facts of one HF Qwen checkpoint, in Megatron's spelling where one exists."""

    architecture: str
    """HF class name, one of SUPPORTED_ARCHITECTURES."""
    num_layers: int
    """HF ``num_hidden_layers``."""
    hidden_size: int
    """Model width (HF ``hidden_size``)."""
    ffn_hidden_size: int
    """HF ``intermediate_size``: width of each of gate_proj / up_proj."""
    num_attention_heads: int
    """Number of query heads."""
    num_query_groups: int
    """HF ``num_key_value_heads`` (GQA groups; equal to the head count for MHA)."""
    kv_channels: int
    """HF ``head_dim`` (Qwen3 sets it explicitly, e.g. 128 with hidden 1024 and 16 heads)."""
    vocab_size: int
    """Unpadded vocabulary size (rows of embed_tokens / lm_head in the HF checkpoint)."""
    max_position_embeddings: int
    """Longest sequence the rotary table is built for."""
    rotary_base: float
    """RoPE theta (HF ``rope_theta`` or transformers-5 ``rope_parameters['rope_theta']``)."""
    layernorm_epsilon: float
    """HF ``rms_norm_eps`` (all RMSNorms, including q/k norm)."""
    add_qkv_bias: bool
    """Bias on q/k/v projections (always on for Qwen2, ``attention_bias`` for Qwen3)."""
    qk_layernorm: bool
    """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
    tie_word_embeddings: bool
    """lm_head shares the input embedding (no separate output weight in the checkpoint)."""
    init_method_std: float
    """HF ``initializer_range``; only affects freshly initialised weights."""
    num_moe_experts: Optional[int] = None
    """Mixture of experts: routed experts of every MoE layer (HF ``num_experts``); None for a
    dense model."""
    moe_router_topk: int = 0
    """MoE: experts each token is routed to (HF ``num_experts_per_tok``)."""
    moe_ffn_hidden_size: Optional[int] = None
    """MoE: width of each expert's gate_proj / up_proj (HF ``moe_intermediate_size``)."""
    norm_topk_prob: bool = True
    """MoE: the top-k routing probabilities are renormalised to sum to 1 (HF ``norm_topk_prob``)."""
    moe_aux_loss_coeff: float = 0.0
    """MoE: load-balancing auxiliary loss coefficient (HF ``router_aux_loss_coef``)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """MoE: width of the shared expert every token also passes through, its output scaled by
    sigmoid(``shared_expert_gate`` x) (Qwen3.5-MoE's HF ``shared_expert_intermediate_size``); None: none."""
    layer_types: Optional[tuple[str, ...]] = None
    """Qwen3.5: each layer's token mixer, ``"linear_attention"`` (gated delta net) or
    ``"full_attention"`` (HF ``layer_types``); None for a model of full-attention layers only."""
    linear_conv_kernel_dim: int = 0
    """Delta net: width of the causal depthwise convolution over q/k/v (HF ``linear_conv_kernel_dim``)."""
    linear_key_head_dim: int = 0
    """Delta net: query/key head size (HF ``linear_key_head_dim``)."""
    linear_value_head_dim: int = 0
    """Delta net: value head size (HF ``linear_value_head_dim``)."""
    linear_num_key_heads: int = 0
    """Delta net: query/key heads (HF ``linear_num_key_heads``)."""
    linear_num_value_heads: int = 0
    """Delta net: value heads, a multiple of the key heads (HF ``linear_num_value_heads``)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels RoPE rotates (HF ``partial_rotary_factor``; Qwen3.5: 0.25)."""
    attention_output_gate: bool = False
    """Full attention multiplies its output by sigmoid of a per-head gate that q_proj also
    produces (Qwen3.5: q_proj has 2 x heads x head_dim rows, [query_h; gate_h] per head)."""
    zero_centered_norm: bool = False
    """RMSNorm weights are stored as w - 1 and applied as (1 + w) (Qwen3.5's input, post-attention,
    q/k and final norms; Megatron's ``layernorm_zero_centered_gamma``)."""
    mtp_num_layers: int = 0
    """Multi-token-prediction layers in the checkpoint (HF ``mtp_num_hidden_layers``); their
    ``mtp.*`` tensors are carried through conversion unchanged, not built into the model."""

    @property
    def q_size(self) -> int:
        """Rows of q_proj."""
        return self.num_attention_heads * self.kv_channels

    @property
    def kv_size(self) -> int:
        """Rows of each of k_proj / v_proj."""
        return self.num_query_groups * self.kv_channels

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers are gated delta-net (linear attention) layers."""
        return self.layer_types is not None and LINEAR_ATTENTION in self.layer_types

    def layers_of_type(self, layer_type: str) -> tuple[int, ...]:
        """Global indices of the layers whose token mixer is ``layer_type``."""
        types = self.layer_types or (FULL_ATTENTION,) * self.num_layers
        return tuple(i for i, t in enumerate(types) if t == layer_type)

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_moe_experts is not None


HF_SUBDIR = "hf"
"""Folder inside a checkpoint (converted by `stapo-convert hf-to-mcore`, or saved by the trainer)
holding the HF config, tokenizer and generation files: what `stapo-convert mcore-to-hf` exports with."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def copy_hf_side_files(hf_dir: str, dest: str) -> None:
    """Copy config, tokenizer and generation files (everything but weights) into ``dest``."""
    os.makedirs(dest, exist_ok=True)
    for name in sorted(os.listdir(hf_dir)):
        src = os.path.join(hf_dir, name)
        if os.path.isfile(src) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, os.path.join(dest, name))


def load_hf_config(hf_dir: Union[str, os.PathLike]) -> dict:
    """Read ``config.json`` of an HF folder as a plain dict."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {hf_dir}")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_dict(hf_config: Union[Mapping[str, Any], Any]) -> dict:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    return hf_config.to_dict()  # a transformers PretrainedConfig


def _rope_theta(cfg: dict) -> float:
    """RoPE base from either config generation; only plain (unscaled) RoPE is supported."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(
            f"rope type {rope_type!r} is not supported (only 'default' RoPE); "
            f"rope_parameters={params or None}, rope_scaling={scaling or None}"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise ValueError("config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)


def _partial_rotary(cfg: dict) -> float:
    """HF ``partial_rotary_factor`` (top level, or transformers-5 ``rope_parameters``); Qwen2/3
    rotate whole heads, so anything but 1 is refused for them."""
    factor = float((cfg.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                           cfg.get("partial_rotary_factor", 1.0)))
    if factor != 1.0:
        raise ValueError(f"partial_rotary_factor {factor} is not supported for {cfg.get('architectures')} "
                         "(only Qwen3.5 rotates part of each head)")
    return factor


ARCHITECTURE_OF_MODEL_TYPE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                              "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                              "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                              "qwen3_5": "Qwen3_5ForConditionalGeneration",
                              "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
"""The architecture of a config without ``architectures`` (saved from a bare ``PretrainedConfig``
or edited by hand), from its ``model_type``, as transformers' AutoModelForCausalLM resolves it."""


def _architecture(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in ARCHITECTURE_OF_MODEL_TYPE:
        archs = [ARCHITECTURE_OF_MODEL_TYPE[cfg["model_type"]]]
    if len(archs) == 1 and (archs[0] in VISION_LANGUAGE_ARCHITECTURES or cfg.get("vision_config")):
        raise ValueError(
            f"architecture {archs[0]!r} is a vision-language checkpoint (vision_config, tensors model.visual.*), "
            f"not a text model: `stapo-convert hf-to-mcore` converts its text tower (the vision tower kept aside), "
            f"and `stapo-convert mcore-to-hf --text-only` writes that text tower as a text model "
            f"(Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM), the folder training and rollouts take")
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def check_architecture(hf_config: Union[Mapping[str, Any], Any]) -> str:
    """The config's supported architecture (``architectures``, or without it ``model_type``);
    ValueError naming it otherwise. Checked before any other field: a GPT-2 or Llama config is
    refused for what it is, not for a field it names differently."""
    return _architecture(_as_dict(hf_config))


def _moe_fields(cfg: dict) -> dict:
    """QwenSpec's MoE fields of a Qwen3MoeForCausalLM config; ValueError naming the field for a
    variant the Megatron MoE layer here would not reproduce."""
    # transformers 5 saves ``num_local_experts`` (``num_experts`` is its attribute alias); the
    # released Qwen3-MoE checkpoints spell it ``num_experts``.
    names = [n for n in ("num_experts", "num_local_experts") if cfg.get(n) is not None]
    values = {cfg[n] for n in names}
    if not names:
        raise ValueError("Qwen3MoeForCausalLM config has neither num_experts nor num_local_experts")
    if len(values) > 1:
        raise ValueError(f"num_experts {cfg['num_experts']} and num_local_experts {cfg['num_local_experts']} differ")
    if cfg.get("shared_expert_intermediate_size"):
        raise ValueError(f"shared_expert_intermediate_size {cfg['shared_expert_intermediate_size']} is not "
                         "supported (no shared expert in the Megatron MoE layer built here)")
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(f"decoder_sparse_step {cfg['decoder_sparse_step']} is not supported "
                         "(only every layer a MoE layer, decoder_sparse_step=1)")
    if cfg.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers {cfg['mlp_only_layers']} is not supported (mixed dense/MoE layers)")
    for field, supported in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        if cfg.get(field, supported) != supported:  # DeepSeek-style router fields
            raise ValueError(f"{field} {cfg[field]!r} is not supported (Qwen3-MoE's router: {supported!r})")
    num_experts, topk = int(values.pop()), int(cfg["num_experts_per_tok"])
    if not 1 <= topk <= num_experts:
        raise ValueError(f"num_experts_per_tok {topk} must be in [1, num_experts {num_experts}]")
    return dict(num_moe_experts=num_experts, moe_router_topk=topk,
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                # transformers' Qwen3MoeConfig defaults norm_topk_prob to False; the released
                # checkpoints set it True.
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.001)))


def spec_from_hf_config(hf_config: Union[Mapping[str, Any], Any]) -> QwenSpec:
    """Map an HF Qwen2/Qwen3/Qwen3-MoE config (dict or PretrainedConfig) to a `QwenSpec`.

    Raises ValueError for architectures or features the Megatron GPTModel here does not
    reproduce exactly (other models, scaled RoPE, sliding windows, non-SiLU MLPs, Qwen3
    output-projection bias; for MoE shared experts, mixed dense/MoE layers, other routers).
    """
    cfg = _as_dict(hf_config)
    arch = _architecture(cfg)
    if arch in QWEN35_ARCHITECTURES:
        hybrid = qwen35_fields(cfg)
    else:
        hybrid = dict(rotary_percent=_partial_rotary(cfg))
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (Qwen uses 'silu')")
    if cfg.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported (full causal attention only)")
    heads = int(cfg["num_attention_heads"])
    if arch == "Qwen2ForCausalLM":
        # Qwen2 hard-codes bias on q/k/v (not o_proj) and has no attention_bias field.
        qkv_bias, qk_norm = True, False
    else:
        if cfg.get("attention_bias", False):
            # Qwen3's attention_bias also adds an o_proj bias, which Megatron can only express
            # with add_bias_linear (which would add MLP biases too).
            raise ValueError(f"{arch} with attention_bias=True is not supported (o_proj bias)")
        qkv_bias, qk_norm = False, True
    moe = (_moe_fields(cfg) if arch == "Qwen3MoeForCausalLM" else
           qwen35_moe_fields(cfg) if arch == "Qwen3_5MoeForCausalLM" else {})
    return QwenSpec(
        architecture=arch,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=int(cfg["hidden_size"]),
        # MoE: the dense width is unused (every layer is MoE) but kept for the record (Qwen3.5-MoE
        # configs have none: the shared expert's).
        ffn_hidden_size=int(cfg["intermediate_size"] if "intermediate_size" in cfg
                            else cfg["shared_expert_intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        # Same fallback as transformers' Qwen2Attention when head_dim is absent or null.
        kv_channels=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg["max_position_embeddings"]),
        rotary_base=_rope_theta(cfg),
        layernorm_epsilon=float(cfg["rms_norm_eps"]),
        add_qkv_bias=qkv_bias,
        qk_layernorm=qk_norm,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        **moe,
        **hybrid,
    )


def dense_layer_params(spec: QwenSpec) -> int:
    """Parameters of one decoder layer outside its experts: q/k/v/o, the two RMSNorms, the q/k
    norms, and the dense gate/up/down (a dense model) or the router (an MoE layer)."""
    h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
    attention = h * (q * (2 if spec.attention_output_gate else 1) + 2 * kv) + q * h
    mlp = h * spec.num_moe_experts if spec.is_moe else 3 * h * spec.ffn_hidden_size
    if spec.moe_shared_expert_intermediate_size:  # gate/up/down and its one-row gate
        mlp += 3 * h * spec.moe_shared_expert_intermediate_size + h
    norms = 2 * h + (2 * spec.kv_channels if spec.qk_layernorm else 0)
    return attention + mlp + norms


def expert_params(spec: QwenSpec) -> int:
    """Parameters of one expert (gate/up/down of width ``moe_ffn_hidden_size``); 0 for a dense model."""
    return 3 * spec.hidden_size * spec.moe_ffn_hidden_size if spec.is_moe else 0


def num_params(spec: QwenSpec) -> int:
    """Parameters of the HF model (unpadded vocabulary; every expert of an MoE)."""
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    experts = (spec.num_moe_experts or 0) * expert_params(spec)
    total = spec.num_layers * (dense_layer_params(spec) + experts) + embeddings + spec.hidden_size
    if spec.is_hybrid:  # delta-net layers: their token mixer instead of attention and q/k norms
        h, q, kv = spec.hidden_size, spec.q_size, spec.kv_size
        attention = h * (2 * q + 2 * kv) + q * h + 2 * spec.kv_channels
        total += len(spec.layers_of_type(LINEAR_ATTENTION)) * (delta_net_params(spec) - attention)
    return total


def num_active_params(spec: QwenSpec) -> int:
    """Parameters one token passes through: `num_params` with ``moe_router_topk`` experts per MoE
    layer instead of all of them (= `num_params` for a dense model)."""
    if not spec.is_moe:
        return num_params(spec)
    idle = spec.num_moe_experts - spec.moe_router_topk
    return num_params(spec) - spec.num_layers * idle * expert_params(spec)
