"""mcore-to-hf: a Megatron torch_dist checkpoint -> an HF folder transformers and vLLM load.

Accepts checkpoints written by `hf-to-mcore` and by the trainer (both carry the HF config and
tokenizer in ``hf/``: `stapo_megatron.runlog.provenance`), and other training checkpoints (a
Megatron-LM run directory, or one of its step directories), for which ``hf_config_dir`` names
the model's config.json and tokenizer (it also overrides a checkpoint's own ``hf/``).
Optimizer state in the checkpoint is ignored.

A checkpoint of a Qwen3.5 vision-language model's text tower (its ``hf/config.json`` is the
vision-language config) is exported as that vision-language model: the text tensors under its
names (``model.language_model.*``, `bridge.vision_language`) and the vision tower put back
verbatim, from ``hf/vision_tower.safetensors`` (written by `hf-to-mcore`) or from the
vision-language HF folder ``hf_config_dir`` names; or, asked for (``text_only``), as the text
model alone (``Qwen3_5ForCausalLM``, the text config; the vision tower is not written).

Streaming: each HF tensor is read as one region of the stored tensor (one layer's slice, or
row blocks of the embedding) and appended to a safetensors shard whose header was written up
front, so memory stays at one layer's tensors whatever the model size.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import warnings
from typing import Iterator, Optional, TextIO

import torch

from stapo_megatron.conversion.dcp_io import CheckpointReader, is_complete
from stapo_megatron.conversion.hf_to_mcore import HF_SUBDIR, copy_hf_side_files, load_spec
from stapo_megatron.conversion.publish import Progress, check_output_dir, staged_output
from stapo_megatron.conversion.safetensors_io import (INDEX_NAME, SINGLE_NAME, ShardWriter, TensorInfo, cast_checked,
                                                      index_checkpoint, read_header, read_tensor)
from stapo_megatron.bridge.hf_config import QwenSpec, load_hf_config
from stapo_megatron.bridge.mapping import (CARRIED_PREFIX, ParamMapping, checkpoint_parts, hf_shapes, mappings_for,
                                           megatron_shape)
from stapo_megatron.bridge.transforms import split_qkv_pieces
from stapo_megatron.bridge.vision_language import (VISION_FILE, VISION_PREFIX, text_config,
                                                   vision_language_architecture, vision_language_name)

DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
"""Largest safetensors shard written (transformers' historical default of 5 GB)."""


def resolve_checkpoint_dir(path: str) -> str:
    """The directory holding the dist checkpoint itself.

    Follows a run's newest-checkpoint marker: ``latest`` (stapo_megatron.mcore.checkpoint, also under
    ``<run>/checkpoints``) or Megatron-LM's ``latest_checkpointed_iteration.txt``.
    """
    if os.path.isfile(path):
        raise ValueError(f"checkpoint path {path} is a file, not a checkpoint directory: give the folder "
                         f"(a checkpoint, or a run folder with its latest marker), e.g. {os.path.dirname(path) or '.'}")
    for root in (path, os.path.join(path, "checkpoints")):
        marker, tracker = os.path.join(root, "latest"), os.path.join(root, "latest_checkpointed_iteration.txt")
        if os.path.isfile(marker):
            with open(marker, encoding="utf-8") as f:
                path = os.path.join(root, f.read().strip())
            break
        if os.path.isfile(tracker):
            with open(tracker, encoding="utf-8") as f:
                it = f.read().strip()
            if it != "release" and not it.isdigit():
                raise ValueError(f"{tracker}: expected an iteration number or 'release', got {it!r}")
            path = os.path.join(root, "release" if it == "release" else f"iter_{int(it):07d}")
            break
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not is_complete(path):
        raise ValueError(
            f"{path} is not a complete torch_dist checkpoint (.metadata or metadata.json missing: "
            "not a Megatron checkpoint, or its save was interrupted)"
        )
    return path


def find_hf_side_dir(ckpt: str, ckpt_dir: str, hf_config_dir: Optional[str]) -> str:
    """Where config.json and tokenizer files come from."""
    candidates = [hf_config_dir] if hf_config_dir else [os.path.join(ckpt_dir, HF_SUBDIR), os.path.join(ckpt, HF_SUBDIR)]
    for d in candidates:
        if os.path.isfile(os.path.join(d, "config.json")):
            return d
    raise FileNotFoundError(
        f"no HF config.json in {' or '.join(candidates)} (checkpoints written by hf-to-mcore or this "
        "trainer carry one; others do not): pass --hf-config DIR (the HF folder the run started from)"
    )


def check_stored(spec: QwenSpec, stored: dict, padded_vocab_hint: int) -> None:
    """Every Megatron tensor the config implies is stored, with a compatible global shape."""
    for m, key, want in _stored_keys(spec, padded_vocab_hint):
        if key not in stored:
            raise ValueError(f"checkpoint has no tensor {key} (needed for {spec.architecture})")
        stored_dtype = stored[key].properties.dtype
        if not stored_dtype.is_floating_point:
            raise ValueError(f"checkpoint tensor {key} has dtype {stored_dtype}; weights must be floating-point")
        got = tuple(stored[key].size)
        if m.transform == "vocab":
            if got[1:] != want[1:] or got[0] < spec.vocab_size:
                raise ValueError(
                    f"checkpoint tensor {key} has shape {got} but the config implies "
                    f"({spec.vocab_size} or more padded rows, {want[1]})"
                )
        elif got != want:
            raise ValueError(f"checkpoint tensor {key} has shape {got} but the config implies {want}")


def _stored_keys(spec: QwenSpec, padded_vocab_hint: int) -> Iterator[tuple[ParamMapping, str, tuple]]:
    """(row, checkpoint key, global shape) of every tensor the config implies: one per row, one
    per layer of an unstacked row, one per piece of a split row."""
    for m in mappings_for(spec):
        shape = megatron_shape(m, spec, padded_vocab_hint)
        keys = sorted({m.checkpoint_key_at(index) for index in m.indices(spec)})
        for key in keys:
            parts = checkpoint_parts(m, spec)
            if not parts:
                yield m, key, m.checkpoint_lead(spec) + shape
            for suffix, _, _, rows in parts:
                yield m, f"{key}.{suffix}", m.checkpoint_lead(spec) + (rows,) + shape[1:]


def _read_layer(reader: CheckpointReader, m: ParamMapping, index: tuple, shape: tuple, row0: int = 0,
                rows: Optional[int] = None, suffix: str = "") -> torch.Tensor:
    """Rows ``[row0, row0 + rows)`` of one layer's (or one layer's one expert's, ``index`` =
    (layer, expert)) slice of a layer-stacked tensor (or of its layer's key, unstacked; of a
    piece's key ``<key>.<suffix>``, split)."""
    rows = shape[0] - row0 if rows is None else rows
    key, lead = m.checkpoint_key_at(index) + (f".{suffix}" if suffix else ""), m.stored_lead(index)
    offsets = lead + (row0,) + (0,) * (len(shape) - 1)
    region = reader.read({key: (offsets, (1,) * len(lead) + (rows,) + shape[1:])})[key]
    return region.reshape((rows,) + shape[1:])


def _row_blocks(reader: CheckpointReader, key: str, rows: int, row_shape: tuple) -> Iterator[torch.Tensor]:
    """Rows ``[0, rows)``, one stored chunk at a time: a read straddling or splitting stored
    chunks would load a chunk more than once. Converted checkpoints store the vocabulary in
    blocks of BLOCK_BYTES; a training checkpoint's chunk is its TP shard of the vocabulary."""
    bounds = [b for b in reader.row_boundaries(key) if b < rows] + [rows]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        yield reader.read({key: ((lo,) + (0,) * len(row_shape), (hi - lo,) + row_shape)})[key]


def hf_tensors(reader: CheckpointReader, m: ParamMapping, lead: tuple,
               spec: QwenSpec) -> list[tuple[str, Iterator[torch.Tensor]]]:
    """The HF tensors of one mapping row at one index ``lead`` (``()``, ``(layer,)`` or
    ``(layer, expert)``, see `ParamMapping.indices`), each as an iterator of contiguous pieces
    whose concatenation along dim 0 is the tensor (so no piece is copied to be written)."""
    names = m.hf_names(*lead)
    if m.per_layer:
        shape = megatron_shape(m, spec, spec.vocab_size)
        if checkpoint_parts(m, spec):  # each HF tensor: its pieces' keys in order
            parts = [[] for _ in names]
            for suffix, i, _, rows in checkpoint_parts(m, spec):
                parts[i].append(_read_layer(reader, m, lead, (rows,) + shape[1:], suffix=suffix))
        elif m.transform == "qkv":
            full = _read_layer(reader, m, lead, shape)
            parts = split_qkv_pieces(full, spec.num_attention_heads, spec.num_query_groups, spec.kv_channels,
                                     spec.attention_output_gate)
        elif m.transform == "gate_up":
            # Stored in the TP=1 layout [gate; up]; reading the halves separately matches the
            # chunks hf-to-mcore writes (one read each instead of a read into a merged buffer).
            ffn = shape[0] // 2
            parts = [[_read_layer(reader, m, lead, shape, 0, ffn)], [_read_layer(reader, m, lead, shape, ffn, ffn)]]
        else:
            parts = [[_read_layer(reader, m, lead, shape)]]
        return [(n, iter(p)) for n, p in zip(names, parts)]
    shape = hf_shapes(spec)[names[0]]
    # Vocabulary rows beyond vocab_size are Megatron's padding; they are simply not read.
    return [(names[0], _row_blocks(reader, m.checkpoint_key, shape[0], shape[1:]))]


def _shard_plan(entries: list[tuple[str, torch.dtype, tuple]], max_shard_bytes: int) -> list[list]:
    shards, size = [[]], 0
    for entry in entries:
        nbytes = math.prod(entry[2]) * torch.empty((), dtype=entry[1]).element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    return shards


def vision_tower(side_dir: str) -> dict[str, TensorInfo]:
    """The vision tower of a vision-language checkpoint's export: ``side_dir/vision_tower.safetensors``
    (a converted checkpoint's ``hf/``), or the ``model.visual.*`` tensors of the HF folder
    ``side_dir`` is; ValueError naming both places when neither holds it."""
    path = os.path.join(side_dir, VISION_FILE)
    if os.path.isfile(path):
        return read_header(path)
    try:
        vision = {n: i for n, i in index_checkpoint(side_dir).items() if n.startswith(VISION_PREFIX)}
    except FileNotFoundError:
        vision = {}
    if not vision:
        raise ValueError(f"{side_dir}/config.json is a vision-language config but neither {path} nor that folder's "
                         f"safetensors hold its vision tower ({VISION_PREFIX}*): pass --hf-config the converted "
                         f"checkpoint's hf/ folder or the vision-language HF folder, or --text-only to export "
                         f"the text model alone")
    return vision


def _write_config(side_dir: str, dest: str, dtype: torch.dtype, text_only: bool = False) -> None:
    cfg = load_hf_config(side_dir)
    cfg = text_config(cfg) if text_only else cfg
    name = str(dtype).replace("torch.", "")
    keys = [k for k in ("dtype", "torch_dtype") if k in cfg] or ["dtype"]
    for k in keys:
        cfg[k] = name
    with open(os.path.join(dest, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


def convert_mcore_to_hf(
    ckpt: str,
    out: str,
    dtype: Optional[torch.dtype] = None,
    hf_config_dir: Optional[str] = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    stream: Optional[TextIO] = None,
    text_only: bool = False,
) -> list[str]:
    """Convert; returns the names of the safetensors files written.

    Args:
        dtype: output dtype; default the stored dtype of the embedding (a vision-language
            model's vision tower keeps its own: it is copied, not converted).
        hf_config_dir: HF folder providing config.json and tokenizer (default ``ckpt/hf``).
        max_shard_bytes: largest safetensors shard.
        text_only: a vision-language checkpoint's text tower as the text model alone
            (``Qwen3_5ForCausalLM`` names and config, no vision tower); ValueError for a text model.
    """
    ckpt_dir = resolve_checkpoint_dir(ckpt)
    side_dir = find_hf_side_dir(ckpt, ckpt_dir, hf_config_dir)
    _, spec = load_spec(side_dir)
    vision_language = vision_language_architecture(load_hf_config(side_dir))
    if text_only and not vision_language:
        raise ValueError(f"--text-only exports a vision-language checkpoint's text tower; {side_dir}/config.json is "
                         f"the text model {spec.architecture}'s already")
    vision = vision_tower(side_dir) if vision_language and not text_only else {}
    inputs = [ckpt, ckpt_dir, side_dir]
    check_output_dir(out, overwrite, inputs)
    reader = CheckpointReader(ckpt_dir)
    stored = reader.tensors()
    check_stored(spec, stored, spec.vocab_size)
    dtype = dtype or stored["embedding.word_embeddings.weight"].properties.dtype
    shapes = hf_shapes(spec)
    jobs = [(m, lead) for m in mappings_for(spec) for lead in m.indices(spec)]
    order = [n for m, lead in jobs for n in m.hf_names(*lead)]
    carried = sorted(k for k in stored if k.startswith(CARRIED_PREFIX))  # Qwen3.5's MTP layers
    if spec.mtp_num_layers and not carried:
        warnings.warn(f"config.json declares mtp_num_hidden_layers={spec.mtp_num_layers} but {ckpt_dir} carries no "
                      "mtp.* tensors (a training checkpoint does not): the export has no MTP weights")
    shapes.update({k[len(CARRIED_PREFIX):]: tuple(stored[k].size) for k in carried})
    order += [k[len(CARRIED_PREFIX):] for k in carried]
    # the written name of each text model's tensor: its own, or the vision-language model's
    written = {n: vision_language_name(n) if vision else n for n in order}
    dtypes = {**{written[n]: dtype for n in order}, **{n: i.dtype for n, i in vision.items()}}
    shapes = {**{written[n]: shapes[n] for n in order}, **{n: i.shape for n, i in vision.items()}}
    order = [written[n] for n in order] + sorted(vision)
    shards = _shard_plan([(n, dtypes[n], shapes[n]) for n in order], max_shard_bytes)
    files = [SINGLE_NAME] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    file_of = {entry[0]: f for f, shard in zip(files, shards) for entry in shard}
    nbytes = sum(math.prod(shapes[n]) * torch.empty((), dtype=dtypes[n]).element_size() for n in order)
    progress = Progress("mcore-to-hf", len(order), nbytes, stream)
    with staged_output(out, overwrite, inputs) as tmp:
        writers = iter([(f, shard) for f, shard in zip(files, shards)])
        writer, remaining = None, 0
        # lazily: each mapping row is read only when its tensors are written (memory stays flat)
        streams = itertools.chain(((written[n], blocks) for m, lead in jobs
                                   for n, blocks in hf_tensors(reader, m, lead, spec)),
                                  ((written[k[len(CARRIED_PREFIX):]], _row_blocks(reader, k, stored[k].size[0],
                                                                                  tuple(stored[k].size[1:])))
                                   for k in carried),
                                  ((n, iter([read_tensor(vision[n])])) for n in sorted(vision)))
        for name, blocks in streams:
            if remaining == 0:
                if writer is not None:
                    writer.close()
                fname, shard = next(writers)
                writer, remaining = ShardWriter(os.path.join(tmp, fname), shard), len(shard)
            nbytes = 0
            for block in blocks:
                block = cast_checked(block, dtypes[name], name)
                writer.write(block)
                nbytes += block.nbytes
            remaining -= 1
            progress.update(nbytes)
        writer.close()
        if len(files) > 1:
            index = {"metadata": {"total_size": progress.bytes}, "weight_map": {n: file_of[n] for n in order}}
            with open(os.path.join(tmp, INDEX_NAME), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2)
        copy_hf_side_files(side_dir, tmp)
        _write_config(side_dir, tmp, dtype, text_only)
    progress.close()
    return files
