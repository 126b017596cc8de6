"""hf-to-mcore: an HF Qwen folder -> a Megatron torch_dist checkpoint that loads at any TP/PP.

Streaming: the checkpoint is written chunk by chunk (see `stapo_megatron.conversion.dcp_io`); each chunk is
read from the safetensors shards only when the writer needs it, large tensors in row blocks
of at most `BLOCK_BYTES`, so memory stays flat whatever the model size.

Output layout (``CKPT``):
    metadata.json, common.pt, .metadata, __0_*.distcp   the Megatron dist checkpoint
    hf/                                               config.json, tokenizer and generation files
    hf/vision_tower.safetensors                       a vision-language checkpoint's vision tower, verbatim
    stapo_conversion.json                             what was converted, from where, how
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import warnings
from typing import Iterator, Optional, TextIO

import torch

from stapo_megatron.conversion.dcp_io import BytesObject, Chunk, write_checkpoint
from stapo_megatron.conversion.publish import Progress, check_output_dir, staged_output
from stapo_megatron.conversion.safetensors_io import TensorInfo, copy_tensors, index_checkpoint, read_rows
from stapo_megatron.bridge.hf_config import (  # noqa: F401  (HF_SUBDIR, copy_hf_side_files: used from here)
    HF_SUBDIR,
    QwenSpec,
    check_architecture,
    copy_hf_side_files,
    load_hf_config,
    spec_from_hf_config,
)
from stapo_megatron.bridge.transformer_config import DEFAULT_VOCAB_DIVISOR, check_parallel_sizes, padded_vocab_size
from stapo_megatron.bridge.hf_config import FULL_ATTENTION, LINEAR_ATTENTION
from stapo_megatron.bridge.mapping import (CARRIED_PREFIX, LAYER_PREFIX, carried_names, checkpoint_parts, hf_shapes,
                                           mappings_for, megatron_shape)
from stapo_megatron.bridge.transforms import merge_qkv
from stapo_megatron.bridge.vision_language import VISION_FILE, split_towers, text_config, vision_language_architecture
from stapo_megatron.utils import format_bytes

BLOCK_BYTES = 16 * 2**20
"""Largest chunk read at once (embedding and lm_head are split into row blocks of this size)."""
META_NAME = "stapo_conversion.json"
"""Conversion record inside a converted checkpoint."""
# Linear modules of the local layer spec; each carries an (empty) `_extra_state` ShardedObject.
_LINEAR_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
_EXPERT_LINEAR_MODULES = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")


# config.json fields spec_from_hf_config reads as integers: required, and optional (null allowed).
_INT_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size",
               "max_position_embeddings")
_OPTIONAL_INT_FIELDS = ("num_key_value_heads", "head_dim")
_MOE_INT_FIELDS = ("moe_intermediate_size", "num_experts_per_tok")
_MOE_EXPERT_FIELDS = ("num_experts", "num_local_experts")  # either spelling (bridge/hf_config.py)


def load_spec(hf_dir: str) -> tuple[dict, QwenSpec]:
    """``hf_dir/config.json`` (of a vision-language checkpoint: its text tower's,
    `bridge.vision_language.text_config`) and its QwenSpec; a missing or malformed field is a
    ValueError naming the file and the field."""
    path = os.path.join(hf_dir, "config.json")
    try:
        cfg = load_hf_config(hf_dir)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    try:
        cfg = text_config(cfg) if vision_language_architecture(cfg) else cfg
        arch = check_architecture(cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    optional = _OPTIONAL_INT_FIELDS
    required = _INT_FIELDS
    if arch == "Qwen3_5MoeForCausalLM":  # no dense width; its MoE fields are checked by the bridge
        required = tuple(f for f in _INT_FIELDS if f != "intermediate_size")
    if arch == "Qwen3MoeForCausalLM":
        required += _MOE_INT_FIELDS
        optional += _MOE_EXPERT_FIELDS
        if all(cfg.get(f) is None for f in _MOE_EXPERT_FIELDS):
            raise ValueError(f"{path}: required field 'num_experts' (or 'num_local_experts') is missing")
    for field in required + optional:
        value = cfg.get(field)
        if value is None and field in optional:
            continue
        if field not in cfg:
            raise ValueError(f"{path}: required field {field!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{path}: field {field!r} must be a positive integer, got {value!r}")
    eps = cfg.get("rms_norm_eps")
    if "rms_norm_eps" not in cfg:
        raise ValueError(f"{path}: required field 'rms_norm_eps' is missing")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"{path}: field 'rms_norm_eps' must be a number in (0, 1), got {eps!r}")
    try:
        return cfg, spec_from_hf_config(cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def check_tensors(spec: QwenSpec, infos: dict[str, TensorInfo]) -> None:
    """Every tensor the config implies exists with the implied shape and a floating-point dtype;
    extras are reported."""
    expected = hf_shapes(spec)
    missing = [n for n in expected if n not in infos]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors the config implies, e.g. {missing[:5]}")
    for name, shape in expected.items():
        if not infos[name].dtype.is_floating_point:
            raise ValueError(f"tensor {name} has dtype {infos[name].dtype}; weights must be floating-point")
        if infos[name].shape != shape:
            raise ValueError(
                f"tensor {name} has shape {infos[name].shape} in the checkpoint but the config implies {shape}"
            )
    extra = sorted(set(infos) - set(expected) - set(carried_names(spec, infos)))
    vision = [n for n in extra if n.startswith(("model.visual.", "visual."))]
    if vision:
        raise ValueError(f"the checkpoint holds {len(vision)} vision-tower tensors (e.g. {vision[0]}) that "
                         f"{spec.architecture} does not use: converting it as a text model would drop them")
    if spec.mtp_num_layers and not carried_names(spec, infos):
        warnings.warn(f"config.json declares mtp_num_hidden_layers={spec.mtp_num_layers} but the checkpoint holds "
                      "no mtp.* tensors: the converted checkpoint has no MTP weights")
    beyond = sorted({int(n.split(".")[2]) for n in extra if n.startswith("model.layers.") and n.split(".")[2].isdigit()})
    if beyond:
        raise ValueError(
            f"the checkpoint holds weights of layers {beyond[0]}..{beyond[-1]} but the config's num_hidden_layers "
            f"is {spec.num_layers}: config.json does not describe these weights (converting would drop "
            f"{len(beyond)} layers)")
    if extra:
        why = " (tie_word_embeddings=True: lm_head is the embedding)" if extra == ["lm_head.weight"] else ""
        warnings.warn(f"ignoring {len(extra)} tensors not used by {spec.architecture}{why}: {extra[:5]}")


def _row_chunks(key: str, global_shape: tuple, lead: tuple, info: TensorInfo, dtype: torch.dtype,
                row0: int = 0, name: str = "", src: Optional[tuple[int, int]] = None) -> list[Chunk]:
    """Chunks copying rows ``src`` (default all) of ``info`` into rows ``row0..`` of a
    (layer-stacked) global tensor."""
    first, last = src or (0, info.shape[0])
    step = max(1, BLOCK_BYTES // (info.nbytes // info.shape[0]))  # rows per block
    ones, zeros = (1,) * len(lead), (0,) * (len(info.shape) - 1)
    chunks = []
    for start in range(first, last, step):
        stop = min(last, start + step)
        chunks.append(Chunk(key, global_shape, lead + (row0 + start - first,) + zeros,
                            ones + (stop - start,) + info.shape[1:],
                            dtype, functools.partial(_finite_rows, name or key, info, start, stop)))
    return chunks


def _finite_rows(name: str, info: TensorInfo, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
    """``read_rows``, refusing NaN or infinite weights (they would convert silently and only show
    up as NaN logits in ``verify`` or training)."""
    rows = read_rows(info, start, stop)
    if not torch.isfinite(rows).all():
        bad = rows.numel() - int(torch.isfinite(rows).sum())
        nan = int(torch.isnan(rows).sum())
        raise ValueError(f"tensor {name} ({info.path}) holds {bad} non-finite values ({nan} NaN) in rows "
                         f"{start}..{start + rows.shape[0]}: the checkpoint is damaged")
    return rows


def _merged_qkv(infos: list[TensorInfo], names: list[str], spec: QwenSpec) -> torch.Tensor:
    q, k, v = (_finite_rows(n, i) for n, i in zip(names, infos))
    return merge_qkv(q, k, v, spec.num_query_groups, spec.kv_channels, spec.attention_output_gate)


def plan_chunks(spec: QwenSpec, infos: dict[str, TensorInfo], padded_vocab: int, dtype: torch.dtype) -> list[Chunk]:
    """The Megatron checkpoint as chunks of HF tensors, in mapping-table order. Per-layer
    tensors have a leading layer axis, per-expert tensors (MoE) leading (layer, global expert)
    axes, as megatron-core's sharded state dict keys them."""
    chunks = []
    for m in mappings_for(spec):
        shape = megatron_shape(m, spec, padded_vocab)
        global_shape = m.checkpoint_lead(spec) + shape
        for index in m.indices(spec):
            names = m.hf_names(*index)
            srcs = [infos[n] for n in names]
            key, lead = m.checkpoint_key_at(index), m.stored_lead(index)
            if checkpoint_parts(m, spec):  # one key per piece, each from a row range of an HF tensor
                for suffix, i, row0, rows in checkpoint_parts(m, spec):
                    chunks += _row_chunks(f"{key}.{suffix}", m.checkpoint_lead(spec) + (rows,) + shape[1:], lead,
                                          srcs[i], dtype, name=names[i], src=(row0, row0 + rows))
            elif m.transform == "qkv":
                # Interleaved per query group: one merged chunk per layer.
                chunks.append(Chunk(key, global_shape, lead + (0,) * len(shape), (1,) * len(lead) + shape, dtype,
                                    functools.partial(_merged_qkv, srcs, names, spec)))
            elif m.transform == "gate_up":
                # The checkpoint layout is [gate; up] (TP-independent), so each is its own chunk.
                chunks += _row_chunks(key, global_shape, lead, srcs[0], dtype, name=names[0])
                chunks += _row_chunks(key, global_shape, lead, srcs[1], dtype, row0=srcs[0].shape[0], name=names[1])
            else:
                chunks += _row_chunks(key, global_shape, lead, srcs[0], dtype, name=names[0])
            if m.transform == "vocab" and padded_vocab > spec.vocab_size:
                pad_shape = (padded_vocab - spec.vocab_size, spec.hidden_size)
                chunks.append(Chunk(key, global_shape, (spec.vocab_size, 0), pad_shape, dtype,
                                    functools.partial(torch.zeros, pad_shape, dtype=dtype)))
    for name in carried_names(spec, infos):  # Qwen3.5's MTP layers: stored as they are
        info = infos[name]
        chunks += _row_chunks(CARRIED_PREFIX + name, info.shape, (), info, dtype, name=name)
    return chunks


def check_free_space(out: str, nbytes: int) -> None:
    """OSError (ENOSPC) before writing anything if the file system of ``out`` has less than
    ``nbytes`` free."""
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    free = shutil.disk_usage(parent).free
    if free < nbytes:
        raise OSError(errno.ENOSPC, f"the checkpoint needs {format_bytes(nbytes)} but the file system of "
                                    f"{parent} has {format_bytes(free)} free ({format_bytes(nbytes - free)} "
                                    "more needed); nothing was written", out)


@contextlib.contextmanager
def failed_writes_named(out: str) -> Iterator[None]:
    """Turn torch.save's raw failure on a full disk or past the file size limit (``RuntimeError:
    [enforce fail at inline_container.cc] ... file write failed``, torch 2.x) into an OSError
    naming the output; the staged folder is removed by `staged_output` either way."""
    try:
        yield
    except RuntimeError as e:
        if "inline_container" not in str(e) and "write failed" not in str(e):
            raise
        raise OSError(errno.ENOSPC, "writing the checkpoint failed (the disk is full or a file size limit was "
                                    "reached); nothing was written, free space and run again", out) from None


def extra_state_objects(spec: QwenSpec) -> list[BytesObject]:
    """The `_extra_state` ShardedObjects megatron-core writes for local-spec linears (value [None]),
    keyed as ``ShardedObject.unique_key``: ``<key>/shard_<offsets>_<shape>`` (dot-joined), with
    (layer, global expert) offsets for the experts' linears."""
    L = spec.num_layers
    if spec.is_hybrid:  # keyed per layer, without a layer axis (megatron-core: offset 0 of shape 1)
        modules = {LINEAR_ATTENTION: ("self_attention.in_proj", "self_attention.out_proj"),
                   FULL_ATTENTION: _LINEAR_MODULES[:2]}
        mlp = (("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
               if spec.moe_shared_expert_intermediate_size else ()) if spec.is_moe else _LINEAR_MODULES[2:]
        E = spec.num_moe_experts
        experts = [f"{mod}._extra_state/shard_{e}_{E}" for mod in _EXPERT_LINEAR_MODULES for e in range(E or 0)]
        return [BytesObject(f"{LAYER_PREFIX}{layer}.{name}", [None])
                for layer, layer_type in enumerate(spec.layer_types)
                for name in [f"{mod}._extra_state/shard_0_1" for mod in modules[layer_type] + mlp] + experts]
    objects = [BytesObject(f"{LAYER_PREFIX}{mod}._extra_state/shard_{layer}_{L}", [None])
               for mod in _LINEAR_MODULES[:2] for layer in range(L)]
    if not spec.is_moe:
        return objects + [BytesObject(f"{LAYER_PREFIX}{mod}._extra_state/shard_{layer}_{L}", [None])
                          for mod in _LINEAR_MODULES[2:] for layer in range(L)]
    E = spec.num_moe_experts
    return objects + [BytesObject(f"{LAYER_PREFIX}{mod}._extra_state/shard_{layer}.{e}_{L}.{E}", [None])
                      for mod in _EXPERT_LINEAR_MODULES for layer in range(L) for e in range(E)]


def convert_hf_to_mcore(
    hf_dir: str,
    out: str,
    dtype: Optional[torch.dtype] = None,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
    overwrite: bool = False,
    thread_count: int = 2,
    stream: Optional[TextIO] = None,
) -> dict:
    """Convert; returns the conversion record also written to ``out/stapo_conversion.json``.

    Args:
        dtype: stored dtype; default the dtype of the HF embedding.
        tensor_model_parallel_size, pipeline_model_parallel_size: the layout the checkpoint is
            meant for; checked against the head and layer counts, and the stored vocabulary is
            padded for this TP (other TP/PP sizes load it too).
        expert_model_parallel_size: the EP it is meant for (MoE), checked against the expert
            count (the checkpoint stores every expert; any EP loads it).

    A Qwen3.5 vision-language checkpoint converts its text tower (`bridge.vision_language`); its
    vision tower is copied verbatim into ``out/hf/vision_tower.safetensors``, for the export.
    """
    _, spec = load_spec(hf_dir)
    check_parallel_sizes(spec, tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size)
    check_output_dir(out, overwrite, inputs=[hf_dir])
    infos = index_checkpoint(hf_dir)
    vision_language, vision = vision_language_architecture(load_hf_config(hf_dir)), {}
    if vision_language:  # the text tower under its text model's names; the vision tower aside
        text_names, vision_names = split_towers(infos)
        vision = {n: infos[n] for n in vision_names}
        infos = {name: infos[stored] for name, stored in text_names.items()}
    check_tensors(spec, infos)
    dtype = dtype or infos["model.embed_tokens.weight"].dtype
    padded = padded_vocab_size(spec.vocab_size, tensor_model_parallel_size, make_vocab_size_divisible_by)
    chunks = plan_chunks(spec, infos, padded, dtype)
    total = sum(torch.Size(c.sizes).numel() for c in chunks) * torch.empty((), dtype=dtype).element_size()
    progress = Progress("hf-to-mcore", len(chunks), total, stream)
    record = {
        "format": "stapo-megatron torch_dist from HF", "version": 1, "architecture": spec.architecture,
        "source": os.path.abspath(hf_dir), "dtype": str(dtype).replace("torch.", ""),
        "vocab_size": spec.vocab_size, "padded_vocab_size": padded,
        "tensor_model_parallel_size": tensor_model_parallel_size,
        "pipeline_model_parallel_size": pipeline_model_parallel_size,
        "expert_model_parallel_size": expert_model_parallel_size,
    }
    if vision_language:
        record["vision_language"] = {"architecture": vision_language, "vision_tower": f"{HF_SUBDIR}/{VISION_FILE}",
                                     "num_vision_tensors": len(vision)}
    check_free_space(out, total + sum(info.nbytes for info in vision.values()))
    with staged_output(out, overwrite, inputs=[hf_dir]) as tmp, failed_writes_named(out):
        write_checkpoint(tmp, chunks, extra_state_objects(spec), thread_count=thread_count,
                         on_chunk=progress.update)
        copy_hf_side_files(hf_dir, os.path.join(tmp, HF_SUBDIR))
        if vision:
            copy_tensors(vision, os.path.join(tmp, HF_SUBDIR, VISION_FILE))
        with open(os.path.join(tmp, META_NAME), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)
    progress.close()
    return record
