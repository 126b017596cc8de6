"""Rollouts: the in-process vLLM engine (`vllm_engine`) and the Megatron -> vLLM weight sync
(`weight_sync`). Importing this package does not import vllm or megatron-core."""

from stapo_megatron.rollout.vllm_engine import RolloutConfig, Sample, VLLMEngine
from stapo_megatron.rollout.weight_sync import iter_hf_weights, sync_weights

__all__ = ["RolloutConfig", "Sample", "VLLMEngine", "iter_hf_weights", "sync_weights"]
