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

Qwen3.5 (hybrid layers): a row names the layers it exists in (``layers``); the delta-net rows
(``linear_attn.*`` <-> ``self_attention.in_proj / conv1d / A_log / dt_bias / out_norm / out_proj``)
cover the linear-attention layers, the attention rows the full-attention ones. megatron-core
keys such a model's checkpoint per layer (``decoder.layers.<l>.<suffix>``, no layer axis:
its ``non_homogeneous_layers``), so those rows are not ``stacked``. The delta net stores its
fused in_proj and conv1d as one key per piece (``in_proj.weight.query`` ...: `checkpoint_parts`).
The checkpoint's ``mtp.*`` tensors (multi-token prediction) are carried unchanged under
``CARRIED_PREFIX`` + their HF name (`carried_names`): kept through a round trip, not built.

Conversion is data: each row names a transform from `stapo_megatron.bridge.transforms`
("copy", "qkv", "gate_up", "vocab", and the delta net's "delta_in_proj", "delta_conv") and the
TP axis Megatron shards the parameter along.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from stapo_megatron.bridge.hf_config import FULL_ATTENTION, LINEAR_ATTENTION, QwenSpec
from stapo_megatron.bridge.hybrid_config import delta_net_dims

LAYER_PREFIX = "decoder.layers."
EXPERT = "#"
"""Expert-index wildcard in mapping rows (local index in Megatron names, global in HF names)."""
_LOCAL_EXPERTS = "mlp.experts.local_experts." + EXPERT + "."
_CHECKPOINT_EXPERTS = "mlp.experts.experts."

# Module names that differ between the local layer spec and the checkpoint/TE spelling.
_LOCAL_SPEC_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.in_proj.layer_norm_weight": "input_layernorm.weight",
}
SPLIT_TRANSFORMS = ("delta_in_proj", "delta_conv")
"""Transforms whose Megatron parameter is stored as one checkpoint key per piece (`checkpoint_parts`)."""
CARRIED_PREFIX = "hf_carried."
"""Checkpoint key prefix of HF tensors carried through conversion unchanged (Qwen3.5's MTP layers)."""
CARRIED_HF_PREFIXES = ("mtp.",)
"""HF tensor name prefixes that are carried (not mapped to a Megatron parameter)."""


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
    layers: Optional[tuple[int, ...]] = None
    """Global layers the row exists in (a hybrid model's token-mixer rows); None: every layer."""
    stacked: bool = True
    """The dist checkpoint stacks the layers along a leading axis; False: one key per layer
    (``decoder.layers.<l>.<suffix>``), as megatron-core keys a hybrid model."""

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
        """Key of this parameter in a Megatron dist checkpoint (layer and expert axes stacked);
        for an unstacked row `checkpoint_key_at` gives each layer's."""
        return self.megatron.replace("*.", "").replace(_LOCAL_EXPERTS, _CHECKPOINT_EXPERTS)

    def checkpoint_key_at(self, lead: tuple = ()) -> str:
        """Key holding index ``lead`` (see `indices`): `checkpoint_key`, with the layer for an
        unstacked row."""
        if self.stacked or not self.per_layer:
            return self.checkpoint_key
        return self.checkpoint_key.replace(LAYER_PREFIX, f"{LAYER_PREFIX}{lead[0]}.", 1)

    def stored_lead(self, lead: tuple) -> tuple:
        """Offsets of index ``lead`` along the stored leading axes (`checkpoint_lead`)."""
        return lead if self.stacked or not self.per_layer else lead[1:]

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
        return (((spec.num_layers,) if self.per_layer and self.stacked else ())
                + ((spec.num_moe_experts,) if self.per_expert else ()))

    def indices(self, spec: QwenSpec) -> list[tuple]:
        """The (global layer, global expert) index tuples of the stored slices, in checkpoint
        order: ``[()]`` for a global parameter, ``[(l,)]`` per layer, ``[(l, e)]`` per expert."""
        if not self.per_layer:
            return [()]
        layers = range(spec.num_layers) if self.layers is None else self.layers
        if not self.per_expert:
            return [(layer,) for layer in layers]
        return [(layer, e) for layer in layers for e in range(spec.num_moe_experts)]


def _layer(megatron: str, hf, transform: str = "copy", tp_axis: Optional[int] = None,
           layers: Optional[tuple[int, ...]] = None) -> ParamMapping:
    hf = (hf,) if isinstance(hf, str) else tuple(hf)
    return ParamMapping(LAYER_PREFIX + "*." + megatron, tuple("model.layers.*." + n for n in hf), transform, tp_axis,
                        layers)


def _attention_rows(spec: QwenSpec) -> list[ParamMapping]:
    """Full attention (every layer, or a hybrid model's full-attention layers)."""
    at = spec.layers_of_type(FULL_ATTENTION) if spec.is_hybrid else None
    rows = [
        _layer("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight", layers=at),
        _layer("self_attention.linear_qkv.weight",
               ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), "qkv", 0, at),
    ]
    if spec.add_qkv_bias:
        rows.append(_layer("self_attention.linear_qkv.bias",
                           ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), "qkv", 0, at))
    if spec.qk_layernorm:
        rows += [_layer("self_attention.q_layernorm.weight", "self_attn.q_norm.weight", layers=at),
                 _layer("self_attention.k_layernorm.weight", "self_attn.k_norm.weight", layers=at)]
    rows.append(_layer("self_attention.linear_proj.weight", "self_attn.o_proj.weight", tp_axis=1, layers=at))
    return rows


def _delta_net_rows(spec: QwenSpec) -> list[ParamMapping]:
    """Gated delta net (a hybrid model's linear-attention layers): HF ``linear_attn.*`` <->
    megatron-core's GatedDeltaNet under ``self_attention``."""
    at = spec.layers_of_type(LINEAR_ATTENTION)
    la = "linear_attn."
    return [
        _layer("self_attention.in_proj.layer_norm_weight", "input_layernorm.weight", layers=at),
        _layer("self_attention.in_proj.weight", (la + "in_proj_qkv.weight", la + "in_proj_z.weight",
                                                 la + "in_proj_b.weight", la + "in_proj_a.weight"),
               "delta_in_proj", 0, at),
        _layer("self_attention.conv1d.weight", la + "conv1d.weight", "delta_conv", 0, at),
        _layer("self_attention.A_log", la + "A_log", tp_axis=0, layers=at),
        _layer("self_attention.dt_bias", la + "dt_bias", tp_axis=0, layers=at),
        _layer("self_attention.out_norm.weight", la + "norm.weight", layers=at),
        _layer("self_attention.out_proj.weight", la + "out_proj.weight", tp_axis=1, layers=at),
    ]


def checkpoint_parts(m: ParamMapping, spec: QwenSpec) -> list[tuple[str, int, int, int]]:
    """How a `SPLIT_TRANSFORMS` row is stored: (key suffix, index into ``m.hf``, first HF row,
    rows) per piece, in megatron-core's order (GatedDeltaNet.sharded_state_dict); [] otherwise."""
    if m.transform not in SPLIT_TRANSFORMS:
        return []
    d = delta_net_dims(spec)
    parts = [("query", 0, 0, d["qk"]), ("key", 0, d["qk"], d["qk"]), ("value", 0, 2 * d["qk"], d["v"])]
    if m.transform == "delta_in_proj":
        parts += [("z", 1, 0, d["v"]), ("beta", 2, 0, d["heads"]), ("alpha", 3, 0, d["heads"])]
    return parts


def carried_names(spec: QwenSpec, names) -> list[str]:
    """The HF tensors among ``names`` carried through conversion unchanged (Qwen3.5's MTP layers)."""
    if not spec.architecture.startswith("Qwen3_5"):
        return []
    return sorted(n for n in names if n.startswith(CARRIED_HF_PREFIXES))


def mappings_for(spec: QwenSpec) -> list[ParamMapping]:
    """The mapping table for one architecture, in checkpoint order (embedding -> layers -> head)."""
    rows = [ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0)]
    rows += _attention_rows(spec)
    if spec.is_hybrid:
        rows += _delta_net_rows(spec)
    if spec.is_moe:
        e = EXPERT
        rows += [
            _layer("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
            _layer("mlp.router.weight", "mlp.gate.weight"),
            _layer(_LOCAL_EXPERTS + "linear_fc1.weight",
                   (f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"), "gate_up", 0),
            _layer(_LOCAL_EXPERTS + "linear_fc2.weight", f"mlp.experts.{e}.down_proj.weight", tp_axis=1),
        ]
        if spec.moe_shared_expert_intermediate_size:  # Qwen3.5-MoE: a gated shared expert
            rows += [
                _layer("mlp.shared_experts.linear_fc1.weight",
                       ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), "gate_up", 0),
                _layer("mlp.shared_experts.linear_fc2.weight", "mlp.shared_expert.down_proj.weight", tp_axis=1),
                _layer("mlp.shared_experts.gate_weight", "mlp.shared_expert_gate.weight"),
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
    if spec.is_hybrid:  # megatron-core keys each layer of a hybrid model on its own
        rows = [dataclasses.replace(r, stacked=False) if r.per_layer else r for r in rows]
    return rows


def _delta_net_shapes(spec: QwenSpec) -> dict[str, tuple[int, ...]]:
    """Shapes of a delta-net layer's ``linear_attn.*`` HF tensors."""
    H, d = spec.hidden_size, delta_net_dims(spec)
    shapes = {"in_proj_qkv.weight": (d["conv"], H), "in_proj_z.weight": (d["v"], H),
              "in_proj_b.weight": (d["heads"], H), "in_proj_a.weight": (d["heads"], H),
              "conv1d.weight": (d["conv"], 1, spec.linear_conv_kernel_dim), "A_log": (d["heads"],),
              "dt_bias": (d["heads"],), "norm.weight": (spec.linear_value_head_dim,), "out_proj.weight": (H, d["v"])}
    return {"linear_attn." + k: v for k, v in shapes.items()}


def _layer_shapes(spec: QwenSpec, experts, layer_type: str = FULL_ATTENTION) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's HF tensors (names without the ``model.layers.<i>.`` prefix), with
    the tensors of the routed ``experts`` for a MoE layer; ``layer_type`` the token mixer's."""
    H, F, d = spec.hidden_size, spec.ffn_hidden_size, spec.kv_channels
    per_layer = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    if layer_type == LINEAR_ATTENTION:
        per_layer.update(_delta_net_shapes(spec))
    else:
        per_layer.update({
            "self_attn.q_proj.weight": (spec.q_size * (2 if spec.attention_output_gate else 1), H),
            "self_attn.k_proj.weight": (spec.kv_size, H),
            "self_attn.v_proj.weight": (spec.kv_size, H),
            "self_attn.o_proj.weight": (H, spec.q_size),
        })
    if spec.is_moe:
        Fe = spec.moe_ffn_hidden_size
        per_layer["mlp.gate.weight"] = (spec.num_moe_experts, H)
        for e in experts:
            per_layer.update({f"mlp.experts.{e}.gate_proj.weight": (Fe, H), f"mlp.experts.{e}.up_proj.weight": (Fe, H),
                              f"mlp.experts.{e}.down_proj.weight": (H, Fe)})
        Fs = spec.moe_shared_expert_intermediate_size
        if Fs:
            per_layer.update({"mlp.shared_expert.gate_proj.weight": (Fs, H),
                              "mlp.shared_expert.up_proj.weight": (Fs, H),
                              "mlp.shared_expert.down_proj.weight": (H, Fs), "mlp.shared_expert_gate.weight": (1, H)})
    else:
        per_layer.update({"mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F)})
    if layer_type == LINEAR_ATTENTION:
        return per_layer
    if spec.add_qkv_bias:
        per_layer.update({"self_attn.q_proj.bias": (spec.q_size,), "self_attn.k_proj.bias": (spec.kv_size,),
                          "self_attn.v_proj.bias": (spec.kv_size,)})
    if spec.qk_layernorm:
        per_layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return per_layer


def hf_shapes(spec: QwenSpec) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor of the architecture (all layers, all experts)."""
    H = spec.hidden_size
    experts = range(spec.num_moe_experts or 0)
    types = spec.layer_types or (FULL_ATTENTION,) * spec.num_layers
    per_type = {t: _layer_shapes(spec, experts, t) for t in set(types)}
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, H), "model.norm.weight": (H,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, H)
    for i, layer_type in enumerate(types):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in per_type[layer_type].items()})
    return shapes


def megatron_shape(mapping: ParamMapping, spec: QwenSpec, padded_vocab_size: int) -> tuple[int, ...]:
    """Unsharded shape of one Megatron parameter (one layer's, and one expert's, slice)."""
    prefix = "model.layers.0."
    hf = {prefix + k: v for k, v in _layer_shapes(spec, [0]).items()}
    if spec.is_hybrid:
        hf.update({prefix + k: v for k, v in _delta_net_shapes(spec).items()})
    hf.update({"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size), "model.norm.weight": (spec.hidden_size,),
               "lm_head.weight": (spec.vocab_size, spec.hidden_size)})
    shapes = [hf[n] for n in mapping.hf_names(0, 0)]
    if mapping.transform == "vocab":
        return (padded_vocab_size,) + shapes[0][1:]
    if mapping.transform in ("qkv", "gate_up", "delta_in_proj"):
        return (sum(s[0] for s in shapes),) + shapes[0][1:]
    return shapes[0]
