"""The rollout engine's side of the memory model (`stapo_megatron.recipes.memory`): whether
vLLM can start beside the trainer's model and optimizer (colocated placement), and what a
separately placed engine's GPU holds beside vLLM's share during a weight transfer. The paper
recipes' check (`stapo_megatron.recipes.paper.layout_problems`, the launcher's dry run) refuses a
layout these find wrong, naming the fields to change."""

from __future__ import annotations

from typing import List

from stapo_megatron.bridge.hf_config import QwenSpec
from stapo_megatron.recipes.memory import FRAMEWORK_OVERHEAD_BYTES, GB, GPU_TOTAL_BYTES, ParallelLayout, memory_estimate

WEIGHT_BUCKETS_RESIDENT = 2
"""Weight buckets an engine GPU holds during a transfer (`stapo_megatron.rollout.weight_receive`):
the one being loaded and the one travelling."""


def engine_staging_bytes(spec: QwenSpec, layout: ParallelLayout) -> float:
    """Separate placement: an engine GPU's weight buckets during a transfer, outside vLLM's share
    (vLLM sizes its KV cache to fill the share): two buckets, each at most the larger of
    ``rollout.weight_bucket_mb`` and the largest bf16 tensor, the embedding (a tensor larger than
    the bucket travels alone); 0 colocated (the in-process engine takes the tensors one at a
    time)."""
    if not layout.engine_ranks:
        return 0.0
    largest = 2 * spec.vocab_size * spec.hidden_size
    return WEIGHT_BUCKETS_RESIDENT * max(layout.weight_bucket_mb * 2**20, largest)


def free_at_engine_start(spec: QwenSpec, layout: ParallelLayout, gpu_bytes: float = GPU_TOTAL_BYTES) -> float:
    """Colocated: the GPU memory free when the trainer builds the engine, after Megatron's model,
    gradient buffer and optimizer (`stapo_megatron.trainer.loop`): the card less their bytes
    (`memory_estimate`: weights, grads, the whole optimizer, which is an upper bound where Adam's
    moments are allocated at the first step, the reference model) and `FRAMEWORK_OVERHEAD_BYTES`
    (CUDA context, NCCL). vLLM empties PyTorch's cache before it measures, so cached blocks count
    as free."""
    est = memory_estimate(spec, layout, gpu_bytes=gpu_bytes)
    return gpu_bytes - (est.weights + est.grads + est.optimizer + est.reference + est.overhead)


def engine_start_problems(spec: QwenSpec, layout: ParallelLayout, gpu_bytes: float = GPU_TOTAL_BYTES) -> List[str]:
    """Why the rollout engine of ``layout`` cannot start or cannot take a weight transfer (empty
    when it can).

    Colocated: vLLM (0.33 ``v1/worker/utils.py`` ``request_memory``) refuses to start unless the
    free memory is at least ``gpu_memory_utilization`` x the card's total, and the trainer builds
    it after the model and optimizer (`free_at_engine_start`). Separate: the engine's share plus
    the transfer's buckets (`engine_staging_bytes`) must fit the card."""
    util = layout.vllm_gpu_memory_utilization
    requested = util * gpu_bytes
    if layout.engine_ranks:
        staging = engine_staging_bytes(spec, layout)
        if requested + staging > gpu_bytes:
            return [f"rollout.gpu_memory_utilization={util} gives vLLM {requested / GB:.1f} GB of an engine GPU's "
                    f"{gpu_bytes / GB:.1f} GB, and a weight transfer holds {staging / GB:.1f} GB of buckets beside it "
                    f"({WEIGHT_BUCKETS_RESIDENT} x the larger of rollout.weight_bucket_mb={layout.weight_bucket_mb} "
                    f"and the embedding): lower either field"]
        return []
    free = free_at_engine_start(spec, layout, gpu_bytes)
    if requested > free:
        return [f"rollout.gpu_memory_utilization={util} asks vLLM to find {requested / GB:.1f} GB free at its start "
                f"({util} x {gpu_bytes / GB:.1f} GB), and the memory model predicts {free / GB:.1f} GB free after "
                f"Megatron's model and optimizer (`free_at_engine_start`): vLLM would refuse to start; lower "
                f"rollout.gpu_memory_utilization to at most {max(0.0, free / gpu_bytes):.2f} or shard the model "
                f"further (model.tensor_model_parallel_size, model.pipeline_model_parallel_size)"]
    return []
