"""The rollout engine's side of the memory model (`stapo_megatron.recipes.memory`): whether
vLLM can start beside the trainer's model and optimizer (colocated placement), and whether a
separately placed engine's GPU has room for a weight transfer beside vLLM's share
(`stapo_megatron.recipes.memory.engine_staging_bytes`). The paper
recipes' check (`stapo_megatron.recipes.paper.layout_problems`, the launcher's dry run) refuses a
layout these find wrong, naming the fields to change."""

from __future__ import annotations

from typing import List

from stapo_megatron.bridge.hf_config import QwenSpec
from stapo_megatron.recipes.memory import (GB, GPU_TOTAL_BYTES, ParallelLayout, engine_staging_bytes,
                                           memory_estimate)

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
                    f"(the buckets of rollout.separate.weight_bucket_mb={layout.weight_bucket_mb} vLLM's reload keeps and "
                    f"the layer it materialises, `engine_staging_bytes`): lower either field"]
        return []
    free = free_at_engine_start(spec, layout, gpu_bytes)
    if requested > free:
        return [f"rollout.gpu_memory_utilization={util} asks vLLM to find {requested / GB:.1f} GB free at its start "
                f"({util} x {gpu_bytes / GB:.1f} GB), and the memory model predicts {free / GB:.1f} GB free after "
                f"Megatron's model and optimizer (`free_at_engine_start`): vLLM would refuse to start; lower "
                f"rollout.gpu_memory_utilization to at most {max(0.0, free / gpu_bytes):.2f} or shard the model "
                f"further (model.tensor_model_parallel_size, model.pipeline_model_parallel_size)"]
    return []
