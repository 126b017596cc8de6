"""Megatron -> vLLM weight sync: a (TP/PP-sharded) GPTModel streamed out as HF tensors.

Owns `iter_hf_weights` (the model on this rank -> full HF ``(name, tensor)`` pairs, one at a
time, identical on every rank) and `sync_weights` (feed them to this rank's `VLLMEngine`).
The conversion is the bridge's: the mapping table of `stapo_megatron.bridge.mapping` and its
pure transforms (QKV split, per-TP-shard gate/up split, vocabulary unpadding), i.e. the same
data the checkpoint converter uses.

Collectives, per HF tensor group: an all-gather over ``groups.tp`` when Megatron shards the
parameter (column-parallel rows or row-parallel columns), then, with PP > 1, a broadcast of the
converted tensors from the stage that owns the layer over ``groups.pp``. Every rank of the
world runs the same sequence of collectives, so every rank ends up with every tensor, and
memory stays at one layer's (gathered) parameters plus the embedding.

Mixture-of-experts layers (Qwen3-MoE): the router is replicated and streamed as any norm; the
experts are split over the expert-parallel group (``groups.ep``, E / EP local experts per rank,
global expert ``ep_rank * E / EP + local``) and each expert's matrices over the expert-TP group.
Every engine needs every expert, so per (layer, expert row, local index) the local expert is
first gathered over expert-TP, then all-gathered over EP: EP tensors at a time, one per
global expert, streamed under their HF per-expert names (``mlp.experts.<e>.gate_proj.weight``).

LoRA (`stapo_megatron.mcore.lora`): each adapted linear's weight is streamed merged,
W0 + (alpha / r) B A, computed on its own shard before the gather (merge-on-sync: the engine
serves a plain model); the adapters' own parameters are not streamed.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist

from stapo_megatron.bridge.hf_config import QwenSpec, spec_from_hf_config
from stapo_megatron.bridge.hybrid_config import delta_net_dims
from stapo_megatron.bridge.mapping import ParamMapping, hf_shapes, mappings_for
from stapo_megatron.bridge.transforms import split_gate_up, split_qkv, split_tp_pieces, unpad_vocab
from stapo_megatron.mcore.lora import MergedParameters, lora_adapters
from stapo_megatron.utils import collective_device


def _unwrap(model) -> torch.nn.Module:
    """The GPTModel inside Megatron DDP / Float16Module wrappers (a one-chunk list is accepted)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"weight sync supports one model chunk per rank, got {len(model)} (virtual pipeline)")
        model = model[0]
    while hasattr(model, "module"):
        model = model.module
    return model


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _group_rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _stage_layers(gpt, pp_group) -> list[list[int]]:
    """Global layer indices held by each pipeline stage (one small all-gather over PP)."""
    local = [int(layer.layer_number) - 1 for layer in gpt.decoder.layers]  # layer_number is 1-based global
    if local and local != list(range(local[0], local[0] + len(local))):
        raise ValueError(f"pipeline stage layers are not contiguous: {local}")
    if _group_size(pp_group) == 1:
        return [local]
    span = torch.tensor([local[0] if local else 0, len(local)], dtype=torch.int64, device=collective_device(pp_group))
    spans = [torch.empty_like(span) for _ in range(_group_size(pp_group))]
    dist.all_gather(spans, span, group=pp_group)
    return [list(range(int(s[0]), int(s[0]) + int(s[1]))) for s in spans]


def _local_param(params: dict, m: ParamMapping, local_layer: Optional[int], expert: Optional[int] = None) -> torch.Tensor:
    # The transformer-engine spec uses the checkpoint spelling, the local spec its own.
    names = [m.megatron_name(local_layer, local_spec=local_spec, expert=expert) for local_spec in (False, True)]
    if m.per_expert:
        # transformer-engine's grouped-GEMM experts: one parameter per local expert,
        # ``mlp.experts.linear_fc1.weight<k>`` (SequentialMLP: ``...local_experts.<k>.linear_fc1.weight``)
        prefix, suffix = names[0].split(f".local_experts.{expert}.")
        names.append(f"{prefix}.{suffix}{expert}")
    for name in names:
        if name in params:
            return params[name]
    raise ValueError(f"model has no parameter {names[0]} (mapping row {m.megatron})")


def _gather_tp(tensor: torch.Tensor, axis: Optional[int], tp_group) -> torch.Tensor:
    """Concatenate the TP shards of a parameter along the axis Megatron splits it."""
    size = _group_size(tp_group)
    if axis is None or size == 1:
        return tensor
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=tp_group)
    return torch.cat(parts, dim=axis)


def _to_hf(full: torch.Tensor, m: ParamMapping, spec: QwenSpec, tp_size: int) -> tuple[torch.Tensor, ...]:
    """A gathered Megatron tensor -> its HF tensors, in ``m.hf`` order."""
    if m.transform == "qkv":
        return split_qkv(full, spec.num_attention_heads, spec.num_query_groups, spec.kv_channels,
                         spec.attention_output_gate)
    if m.transform in ("delta_in_proj", "delta_conv"):
        # The gathered tensor is the in-memory layout: per TP shard [q_i; k_i; v_i (; z_i; b_i; a_i)].
        d = delta_net_dims(spec)
        pieces = split_tp_pieces(full, [d["qk"], d["qk"], d["v"], d["v"], d["heads"], d["heads"]][
            :6 if m.transform == "delta_in_proj" else 3], tp_size)
        return (torch.cat(pieces[:3]), *pieces[3:])  # HF: in_proj_qkv / conv1d, then z, b, a
    if m.transform == "gate_up":
        # The gathered tensor is the in-memory layout [gate_0; up_0; gate_1; up_1; ...].
        return split_gate_up(full, tp_size)
    if m.transform == "vocab":
        return (unpad_vocab(full, spec.vocab_size),)
    return (full,)


def _jobs(spec: QwenSpec, stage_layers: list[list[int]]) -> Iterator[tuple[ParamMapping, Optional[int], int]]:
    """(mapping row, global layer or None, owning PP stage) in HF order, layer-major.

    Layer-major order hands vLLM each decoder layer complete before the next one starts, which
    is what its layer-wise reload processes best.
    """
    rows = mappings_for(spec)
    stage_of = {layer: s for s, layers in enumerate(stage_layers) for layer in layers}
    last = len(stage_layers) - 1
    for m in rows:
        if m.megatron.startswith("embedding."):
            yield m, None, 0
    for layer in range(spec.num_layers):
        for m in rows:
            if m.per_layer and (m.layers is None or layer in m.layers):  # hybrid: this layer's type's rows
                yield m, layer, stage_of[layer]
    for m in rows:
        if not m.per_layer and not m.megatron.startswith("embedding."):
            yield m, None, last


def hf_stream(spec: QwenSpec) -> list[tuple[str, tuple[int, ...]]]:
    """The ``(HF name, shape)`` of every tensor `iter_hf_weights` yields for ``spec``, in its order
    (with EP > 1 the experts of a layer come in another order, still together): what the weight
    transfer's buckets are planned from (`stapo_megatron.rollout.weight_buckets`)."""
    shapes = hf_shapes(spec)
    out = []
    for m, layer, _ in _jobs(spec, [list(range(spec.num_layers))]):
        for expert in range(spec.num_moe_experts) if m.per_expert else [None]:
            out += [(name, tuple(shapes[name])) for name in m.hf_names(layer, expert)]
    return out


def iter_hf_weights(model, hf_config: Union[QwenSpec, dict, Any], groups) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model's weights as full HF Qwen tensors, one at a time, on every rank.

    Args:
        model: this rank's GPTModel from `stapo_megatron.bridge.build_gpt_model`, possibly
            wrapped in Megatron DDP. With DDP ``overlap_param_gather=True`` the caller must
            finish the parameter all-gather of the last optimizer step first.
        hf_config: the HF config (dict / PretrainedConfig) or `QwenSpec` the model was built from.
        groups: `stapo_megatron.mcore.parallel.Groups` of this rank (``tp``, ``pp`` and, for MoE, ``ep`` are used).
    Yields:
        ``(hf_name, tensor)`` in HF checkpoint order (embedding, layers, final norm, lm_head),
        in the model's parameter dtype, on the parameters' device. Every rank of the world must
        consume the whole iterator (it runs collectives).
    """
    spec = hf_config if isinstance(hf_config, QwenSpec) else spec_from_hf_config(hf_config)
    gpt = _unwrap(model)
    params = MergedParameters(gpt)  # detached; LoRA: adapted weights merged as they are read
    first = next(gpt.parameters())
    tp_size, pp_size, pp_rank = _group_size(groups.tp), _group_size(groups.pp), _group_rank(groups.pp)
    stage_layers = _stage_layers(gpt, groups.pp)
    if sorted(l for layers in stage_layers for l in layers) != list(range(spec.num_layers)):
        raise ValueError(f"pipeline stages hold layers {stage_layers}, expected 0..{spec.num_layers - 1} "
                         f"(does hf_config match the model?)")
    pp_ranks = dist.get_process_group_ranks(groups.pp) if pp_size > 1 else None
    shapes = hf_shapes(spec)
    for m, layer, stage in _jobs(spec, stage_layers):
        if m.per_expert:
            local_layer = stage_layers[stage].index(layer) if stage == pp_rank else None
            yield from _expert_tensors(params, m, spec, layer, local_layer, stage, groups, pp_ranks, first)
            continue
        names = m.hf_names(layer)
        if stage == pp_rank:
            local_layer = None if layer is None else stage_layers[stage].index(layer)
            full = _gather_tp(_local_param(params, m, local_layer), m.tp_axis, groups.tp)
            tensors = _to_hf(full, m, spec, tp_size)
        else:
            tensors = tuple(torch.empty(shapes[n], dtype=first.dtype, device=first.device) for n in names)
        for name, tensor in zip(names, tensors):
            if pp_size > 1:
                tensor = tensor.contiguous()
                dist.broadcast(tensor, src=pp_ranks[stage], group=groups.pp)
            yield name, tensor


def _expert_tensors(params, m: ParamMapping, spec: QwenSpec, layer: int, local_layer: Optional[int], stage: int,
                    groups, pp_ranks, like: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One per-expert mapping row of one layer: every global expert's HF tensors (module
    docstring), gathered on the owning PP stage and broadcast to the others."""
    from megatron.core import parallel_state as ps

    ep_group = groups.ep
    etp_group = ps.get_expert_tensor_parallel_group(check_initialized=False)
    ep_size, etp_size = _group_size(ep_group), _group_size(etp_group)
    num_local = spec.num_moe_experts // ep_size
    shapes = hf_shapes(spec)
    for k in range(num_local):
        experts = [r * num_local + k for r in range(ep_size)]
        if local_layer is not None:
            full = _gather_tp(_local_param(params, m, local_layer, expert=k), m.tp_axis, etp_group).contiguous()
            per_rank = [full]
            if ep_size > 1:
                per_rank = [torch.empty_like(full) for _ in range(ep_size)]
                dist.all_gather(per_rank, full, group=ep_group)
            converted = [_to_hf(t, m, spec, etp_size) for t in per_rank]
        else:
            converted = [tuple(torch.empty(shapes[n], dtype=like.dtype, device=like.device)
                               for n in m.hf_names(layer, e)) for e in experts]
        for e, tensors in zip(experts, converted):
            for name, tensor in zip(m.hf_names(layer, e), tensors):
                if pp_ranks is not None:
                    tensor = tensor.contiguous()
                    dist.broadcast(tensor, src=pp_ranks[stage], group=groups.pp)
                yield name, tensor


def sync_weights(model, hf_config: Union[QwenSpec, dict, Any], groups, engine) -> dict:
    """Push the model's current weights into this rank's `VLLMEngine`, streamed; a LoRA policy
    into an engine that ``serves_adapters`` (`stapo_megatron.rollout.vllm_lora`): its adapters.

    Returns:
        ``{"bytes": HF bytes loaded into this rank's engine, "seconds": wall time}``.
    """
    if getattr(engine, "serves_adapters", False) and any(a.enabled for a in lora_adapters(_unwrap(model)).values()):
        return engine.sync_adapters(model, hf_config, groups)  # the adapters alone (the base once)
    start = time.perf_counter()
    total = [0]

    def counted():
        for name, tensor in iter_hf_weights(model, hf_config, groups):
            total[0] += tensor.numel() * tensor.element_size()
            yield name, tensor

    engine.update_weights(counted())
    return {"bytes": total[0], "seconds": time.perf_counter() - start}


def wake_and_sync(model, hf_config: Union[QwenSpec, dict, Any], groups, engine) -> dict:
    """Bring a sleeping engine back with the model's current weights, in the order verl,
    NeMo-RL and slime use: wake the weights only, sync, hand the sync's and training's cached
    memory back, then wake the KV cache. The KV cache (the largest allocation) is mapped only
    after the sync's temporaries (the gathered full tensors) and PyTorch's cached training
    blocks are released, so they are never resident together. Returns `sync_weights`'s
    statistics."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # training's cached blocks, for the weights
    engine.wake_up(tags=("weights",))
    stats = sync_weights(model, hf_config, groups, engine)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the gathered full tensors and training's cached blocks
    engine.wake_up(tags=("kv_cache",))
    return stats
