"""The parameter mapping table: Megatron GPTModel name <-> HF Qwen name(s).

Names use ``*`` for the layer index. Megatron names are the dist-checkpoint spelling, which is
the transformer-engine module spelling (the local layer spec maps ``input_layernorm`` and
``pre_mlp_layernorm`` onto it through ``sharded_state_dict_keys_map``), so one checkpoint
loads under both specs. In a dist checkpoint the per-layer tensors of all layers are one
tensor with a leading layer axis, keyed without the index (``decoder.layers.<suffix>``).

MoE (Qwen3-MoE): the router is ``mlp.router.weight`` <-> ``mlp.gate.weight``; expert rows carry a
second wildcard ``#`` for the expert index: ``mlp.experts.local_experts.#.linear_fc1.weight`` (the
*local* index on this expert-parallel rank) <-> ``mlp.experts.#.gate_proj / up_proj.weight`` (the
global index). In a dist checkpoint megatron-core's SequentialMLP stores each expert parameter as
one tensor with leading (layer, global expert) axes under ``mlp.experts.experts.<suffix>``, so a
checkpoint reshards across EP sizes; transformer-engine's grouped-GEMM experts write the same
keys. The MoE layer's own pre-MLP norm is ``pre_mlp_layernorm.weight`` in both specs.

Conversion is data: each row names a transform from `stapo_megatron.bridge.transforms`
("copy", "qkv", "gate_up", "vocab") and the TP axis Megatron shards the parameter along.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from stapo_megatron.bridge.hf_config import QwenSpec

LAYER_PREFIX = "decoder.layers."
EXPERT = "#"
"""Expert-index wildcard in mapping rows (local index in Megatron names, global in HF names)."""
_LOCAL_EXPERTS = "mlp.experts.local_experts." + EXPERT + "."
_CHECKPOINT_EXPERTS = "mlp.experts.experts."

# Module names that differ between the local layer spec and the checkpoint/TE spelling.
_LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}


@dataclasses.dataclass(frozen=True)
class ParamMapping:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str
    """Megatron name, ``*`` standing for the layer index (e.g. ``decoder.layers.*.mlp.linear_fc2.weight``)."""
    hf: tuple[str, ...]
    """HF names in merge order (q, k, v for "qkv"; gate, up for "gate_up"), same wildcard."""
    transform: str
    """"copy", "qkv" (GQA-grouped merge), "gate_up" (SwiGLU merge) or "vocab" (pad/unpad rows)."""
    tp_axis: Optional[int]
    """Axis Megatron splits over TP ranks (0 column-parallel, 1 row-parallel), None if replicated;
    for expert rows the axis split over expert-TP ranks."""

    @property
    def per_layer(self) -> bool:
        """Whether the name holds a layer wildcard."""
        return "*" in self.megatron

    @property
    def per_expert(self) -> bool:
        """Whether the name holds an expert wildcard (one tensor per routed expert)."""
        return EXPERT in self.megatron

    @property
    def checkpoint_key(self) -> str:
        """Key of this parameter in a Megatron dist checkpoint (layer and expert axes stacked)."""
        return self.megatron.replace("*.", "").replace(_LOCAL_EXPERTS, _CHECKPOINT_EXPERTS)

    def megatron_name(self, layer: Optional[int] = None, local_spec: bool = False,
                      expert: Optional[int] = None) -> str:
        """Module (state_dict) name in a GPTModel for a given *local* layer (and local expert) index."""
        name = self.megatron
        if local_spec:
            suffix = name[len(LAYER_PREFIX) + 2:] if self.per_layer else None
            if suffix in _LOCAL_SPEC_NAMES:
                name = LAYER_PREFIX + "*." + _LOCAL_SPEC_NAMES[suffix]
        name = name.replace(EXPERT, str(expert)) if self.per_expert else name
        return name.replace("*", str(layer)) if self.per_layer else name

    def hf_names(self, layer: Optional[int] = None, expert: Optional[int] = None) -> tuple[str, ...]:
        """HF tensor names for a given (global) layer (and global expert) index."""
        names = tuple(n.replace(EXPERT, str(expert)) for n in self.hf) if self.per_expert else self.hf
        return tuple(n.replace("*", str(layer)) for n in names) if self.per_layer else names

    def checkpoint_lead(self, spec: QwenSpec) -> tuple[int, ...]:
        """Leading axes of this parameter in a dist checkpoint: (layers,) or (layers, experts)."""
        return (((spec.num_layers,) if self.per_layer else ())
                + ((spec.num_moe_experts,) if self.per_expert else ()))

    def indices(self, spec: QwenSpec) -> list[tuple]:
        """The (global layer, global expert) index tuples of the stored slices, in checkpoint
        order: ``[()]`` for a global parameter, ``[(l,)]`` per layer, ``[(l, e)]`` per expert."""
        if not self.per_layer:
            return [()]
        if not self.per_expert:
            return [(layer,) for layer in range(spec.num_layers)]
        return [(layer, e) for layer in range(spec.num_layers) for e in range(spec.num_moe_experts)]


def _layer(megatron: str, hf, transform: str = "copy", tp_axis: Optional[int] = None) -> ParamMapping:
    hf = (hf,) if isinstance(hf, str) else tuple(hf)
    return ParamMapping(LAYER_PREFIX + "*." + megatron, tuple("model.layers.*." + n for n in hf), transform, tp_axis)


def mappings_for(spec: QwenSpec) -> list[ParamMapping]:
    """The mapping table for one architecture, in checkpoint order (embedding -> layers -> head)."""
    rows = [
        ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0),
        _layer("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
        _layer("self_attention.linear_qkv.weight",
               ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv", 0),
    ]
    if spec.add_qkv_bias:
        rows.append(_layer("self_attention.linear_qkv.bias",
                           ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv", 0))
    if spec.qk_layernorm:
        rows += [_layer("self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
                 _layer("self_attention.k_layernorm.weight", "self_attn.k_norm.weight")]
    rows.append(_layer("self_attention.linear_proj.weight", "self_attn.o_proj.weight", tp_axis=1))
    if spec.is_moe:
        e = EXPERT
        rows += [
            _layer("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
            _layer("mlp.router.weight", "mlp.gate.weight"),
            _layer(_LOCAL_EXPERTS + "linear_fc1.weight",
                   (f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"), "gate_up", 0),
            _layer(_LOCAL_EXPERTS + "linear_fc2.weight", f"mlp.experts.{e}.down_proj.weight", tp_axis=1),
        ]
    else:
        rows += [
            _layer("mlp.linear_fc1.layer_norm_weight", "post_attention_layernorm.weight"),
            _layer("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), "gate_up", 0),
            _layer("mlp.linear_fc2.weight", "mlp.down_proj.weight", tp_axis=1),
        ]
    rows.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None))
    if not spec.tie_word_embeddings:
        rows.append(ParamMapping("output_layer.weight", ("lm_head.weight",), "vocab", 0))
    return rows


def _layer_shapes(spec: QwenSpec, experts) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's HF tensors (names without the ``model.layers.<i>.`` prefix), with
    the tensors of the routed ``experts`` for a MoE layer."""
    H, F, d = spec.hidden_size, spec.ffn_hidden_size, spec.kv_channels
    per_layer = {
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (spec.q_size, H),
        "self_attn.k_proj.weight": (spec.kv_size, H),
        "self_attn.v_proj.weight": (spec.kv_size, H),
        "self_attn.o_proj.weight": (H, spec.q_size),
    }
    if spec.is_moe:
        Fe = spec.moe_ffn_hidden_size
        per_layer["mlp.gate.weight"] = (spec.num_moe_experts, H)
        for e in experts:
            per_layer.update({f"mlp.experts.{e}.gate_proj.weight": (Fe, H), f"mlp.experts.{e}.up_proj.weight": (Fe, H),
                              f"mlp.experts.{e}.down_proj.weight": (H, Fe)})
    else:
        per_layer.update({"mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F)})
    if spec.add_qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (spec.q_size,), "self_attn.k_proj.bias": (spec.kv_size,),
                          "self_attn.v_proj.bias": (spec.kv_size,)})
    if spec.qk_layernorm:
        per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return per_layer


def hf_shapes(spec: QwenSpec) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor of the architecture (all layers, all experts)."""
    H = spec.hidden_size
    per_layer = _layer_shapes(spec, range(spec.num_moe_experts or 0))
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, H), "model.norm.weight": (H,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, H)
    for i in range(spec.num_layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def megatron_shape(mapping: ParamMapping, spec: QwenSpec, padded_vocab_size: int) -> tuple[int, ...]:
    """Unsharded shape of one Megatron parameter (one layer's, and one expert's, slice)."""
    prefix = "model.layers.0."
    hf = {prefix + k: v for k, v in _layer_shapes(spec, [0]).items()}
    hf.update({"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size), "model.norm.weight": (spec.hidden_size,),
               "lm_head.weight": (spec.vocab_size, spec.hidden_size)})
    shapes = [hf[n] for n in mapping.hf_names(0, 0)]
    if mapping.transform == "vocab":
        return (padded_vocab_size,) + shapes[0][1:]
    if mapping.transform in ("qkv", "gate_up"):
        return (sum(s[0] for s in shapes),) + shapes[0][1:]
    return shapes[0]
