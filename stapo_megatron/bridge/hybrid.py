"""The Megatron model of a Qwen3.5 (hybrid) spec: its TransformerConfig fields and its decoder
block of gated delta-net and gated full-attention layers, on the local (non-TE) spec.

Layers: each layer of ``spec.layer_types`` is a TransformerLayer whose ``self_attention`` is
megatron-core's ``GatedDeltaNet`` (``ssm/gated_delta_net.py``: fused ``in_proj`` [q k v z b a],
a depthwise causal ``conv1d`` over q/k/v, ``A_log``, ``dt_bias``, the gated ``out_norm``,
``out_proj``) or its ``SelfAttention`` with ``attention_output_gate``; the MLP is the local
SwiGLU MLP. Norms: `norm.TorchNorm` (zero-centred, as Qwen3.5's) except the delta net's output
norm (`norm.PlainRMSNorm`, a plain weight as HF's ``Qwen3_5RMSNormGated``). The local spec maps
``input_layernorm`` to the checkpoint's TE spelling (``self_attention.in_proj.layer_norm_weight``
in delta-net layers), so its checkpoints are keyed as megatron-core's TE block
(``get_transformer_block_with_experimental_attention_variant_spec``) keys them.

Kernels: on CUDA the delta rule runs in flash-linear-attention's (``fla``) Triton kernels, as
megatron-core calls them. On the CPU those refuse to run (fla 0.6.0: "0 active drivers", with or
without ``TRITON_INTERPRET=1``; installed on the CPU, transformers would pick them too and fail
the same way, so fla is a GPU-only requirement), and `stapo_megatron.mcore.cpu_compat` points the module at
`stapo_megatron.mcore.delta_rule` (the same equations in torch, chunked in fp32), a torch L2 norm
and a torch causal convolution.

Versions: megatron-core 0.16 to 0.19 (`mcore_versions`: 0.18 added the packed path and binds the
kernel at construction, 0.19 split the module into the ``ssm/gated_delta_net/`` package). The
parameters and their checkpoint keys are the same in all of them (``in_proj`` one TP shard
[q k v z b a] of this rank's heads, saved as ``in_proj.weight.{query,key,value,z,beta,alpha}``;
``conv1d`` [q k v] as ``conv1d.weight.{query,key,value}``), so one converter serves every release.

Packed sequences (`packed_delta_net`): from 0.18 megatron-core's GatedDeltaNet runs a packed row
itself, the convolution and the recurrence restarting at every sequence of ``cu_seqlens`` (fla's
varlen kernels on CUDA; on the CPU the shim's kernels run each sequence alone); 0.16 and 0.17
refuse ``PackedSeqParams``, and the layer here runs their GatedDeltaNet on each sequence alone.
Either way packed equals padded.
Context parallelism (from megatron-core 0.19, `mcore_versions.delta_net_has_context_parallel`):
the packed row split over the CP ranks as `batch.context_parallel` splits it goes through 0.19's
own forward, which exchanges it all-to-all for whole sequences on 1 / CP of this TP rank's heads,
convolves them with its CP rank's slice of the conv weights and exchanges the output back; the
parameters stay whole on every CP rank, so checkpoints are the same at every CP size. Refused
(`check_delta_net_layout`, ValueError naming the release) on 0.16 to 0.18 (0.16 and 0.17 have
none; 0.18's is not built on here), and from 0.19 when CP does not divide a TP rank's key and
value heads.
Not supported: sequence parallelism with packed delta-net layers, the transformer-engine spec
(`model.build_gpt_model`).
"""

from __future__ import annotations

import copy
from typing import Optional

from stapo_megatron.bridge.hf_config import LINEAR_ATTENTION, QwenSpec
from stapo_megatron.bridge.hybrid_config import delta_net_layout_problems

DELTA_NET_SINCE = (0, 16)
"""The oldest megatron-core release whose GatedDeltaNet the Qwen3.5 model here is built and tested on."""


def delta_net_version_gap() -> Optional[str]:
    """Why the installed megatron-core's GatedDeltaNet is not one this module is written against
    (0.16 to 0.19), or None: a release before 0.16 (`DELTA_NET_SINCE`)."""
    from megatron.core import __version__

    from stapo_megatron.mcore.mcore_versions import mcore_release

    if mcore_release() < DELTA_NET_SINCE:
        return (f"megatron-core {__version__} is older than the GatedDeltaNet the Qwen3.5 model is built on: "
                f"use megatron-core {'.'.join(map(str, DELTA_NET_SINCE))} to 0.19")
    return None


def check_delta_net_version() -> None:
    """ValueError naming the megatron-core version when `delta_net_version_gap` finds one."""
    gap = delta_net_version_gap()
    if gap:
        raise ValueError(gap)


def check_delta_net_layout(spec: QwenSpec, context_parallel_size: int, tensor_model_parallel_size: int) -> None:
    """ValueError with the first of `hybrid_config.delta_net_layout_problems` for this CP and TP
    size (context parallelism before megatron-core 0.19, CP not dividing a TP rank's delta-net heads)."""
    problems = delta_net_layout_problems(spec, context_parallel_size,
                                         tensor_model_parallel_size=tensor_model_parallel_size)
    if problems:
        raise ValueError(problems[0])


def hybrid_settings(spec: QwenSpec) -> dict:
    """TransformerConfig's fields for a Qwen3.5 spec (`hybrid_config` documents each)."""
    if not spec.is_hybrid and not spec.attention_output_gate:
        return {}
    fields = dict(attention_output_gate=spec.attention_output_gate,
                  layernorm_zero_centered_gamma=spec.zero_centered_norm)
    if spec.is_hybrid:
        fields.update(experimental_attention_variant="gated_delta_net",
                      linear_attention_freq=[int(t == LINEAR_ATTENTION) for t in spec.layer_types],
                      linear_conv_kernel_dim=spec.linear_conv_kernel_dim,
                      linear_key_head_dim=spec.linear_key_head_dim,
                      linear_value_head_dim=spec.linear_value_head_dim,
                      linear_num_key_heads=spec.linear_num_key_heads,
                      linear_num_value_heads=spec.linear_num_value_heads)
    return fields


def packed_delta_net():
    """megatron-core's GatedDeltaNet with packed sequences (``PackedSeqParams(qkv_format="thd")``,
    hidden states [t, 1, h]): the convolution and the recurrent state restart at every sequence
    of ``cu_seqlens``, so nothing leaks between packed sequences. From 0.18 megatron-core's own
    forward does it in one call over the row (`mcore_versions.delta_net_takes_packed`; not in its
    deterministic mode, which refuses packed input); 0.16 and 0.17 raise NotImplementedError for
    packed input, and this one runs their forward on each sequence alone (what the padded batch
    computed for it: its right padding comes after it in a causal recurrence). With context
    parallelism (0.19 and later) the row always goes to megatron-core's forward: its CP exchange
    needs the row whole (it refuses deterministic mode for packed input); before 0.19 CP raises."""
    import torch
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron.core import __version__ as megatron_version

    from stapo_megatron.mcore.mcore_versions import delta_net_has_context_parallel, delta_net_takes_packed

    class PackedGatedDeltaNet(GatedDeltaNet):
        """GatedDeltaNet that keeps packed sequences apart (`packed_delta_net`)."""

        def forward(self, hidden_states, attention_mask, *args, packed_seq_params=None, **kwargs):
            if packed_seq_params is None:
                return super().forward(hidden_states, attention_mask, *args, **kwargs)
            if packed_seq_params.qkv_format != "thd" or self.config.sequence_parallel:
                raise ValueError(f"packed delta-net layers need qkv_format 'thd' without sequence parallelism, got "
                                 f"{packed_seq_params.qkv_format!r}, sequence_parallel={self.config.sequence_parallel}")
            if self.config.context_parallel_size > 1 and not delta_net_has_context_parallel():
                raise ValueError(f"packed delta-net layers have no context parallelism on megatron-core "
                                 f"{megatron_version} (model.context_parallel_size "
                                 f"{self.config.context_parallel_size}): it needs megatron-core 0.19 or later")
            if self.config.context_parallel_size > 1 or (delta_net_takes_packed()
                                                         and not self.config.deterministic_mode):
                return super().forward(hidden_states, attention_mask, *args, packed_seq_params=packed_seq_params,
                                       **kwargs)
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            if bounds[-1] < hidden_states.shape[0]:  # the row's padding after its last sequence
                bounds.append(hidden_states.shape[0])
            outs = [super(PackedGatedDeltaNet, self).forward(hidden_states[a:b], attention_mask, *args, **kwargs)
                    for a, b in zip(bounds, bounds[1:])]
            bias = outs[0][1]  # out_proj's bias (skip_bias_add): the same for every sequence
            return torch.cat([out for out, _ in outs]), bias

    return PackedGatedDeltaNet


def delta_net_layer(full_attention_layer):
    """A delta-net layer spec from the local full-attention layer spec: the same norms, MLP and
    residuals, megatron-core's GatedDeltaNet as the token mixer."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from stapo_megatron.bridge.norm import PlainRMSNorm

    layer = copy.deepcopy(full_attention_layer)
    layer.submodules.self_attention = ModuleSpec(
        module=packed_delta_net(),
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=PlainRMSNorm,
                                           out_proj=RowParallelLinear))
    # the full-attention layer's map (MoE layers keep pre_mlp_layernorm's own key), the input norm renamed
    layer.submodules.sharded_state_dict_keys_map = {
        **full_attention_layer.submodules.sharded_state_dict_keys_map,
        "input_layernorm.": "self_attention.in_proj.layer_norm_"}
    return layer


def hybrid_block_spec(spec: QwenSpec, full_attention_layer, config, vp_stage: Optional[int] = None):
    """This pipeline stage's decoder block: each of its layers as ``spec.layer_types`` says, then
    the final norm."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from stapo_megatron.bridge.norm import final_norm

    check_delta_net_version()
    check_delta_net_layout(spec, config.context_parallel_size, config.tensor_model_parallel_size)
    linear = delta_net_layer(full_attention_layer)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage,
                                          pp_rank=ps.get_pipeline_model_parallel_rank())
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = [linear if spec.layer_types[i] == LINEAR_ATTENTION else full_attention_layer
              for i in range(offset, offset + count)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm())
