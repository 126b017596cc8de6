"""Rollouts: the in-process vLLM engine (`vllm_engine`), the transformers engine for machines
without vLLM (`hf_engine`), the choice between them (`engines`) and the Megatron -> engine weight
sync (`weight_sync`). Importing this package does not import vllm or megatron-core."""

from stapo_megatron.rollout.engines import ENGINES, build_engine, resolve_engine
from stapo_megatron.rollout.hf_engine import HFEngine
from stapo_megatron.rollout.vllm_engine import RolloutConfig, Sample, VLLMEngine
from stapo_megatron.rollout.weight_sync import iter_hf_weights, sync_weights

__all__ = ["ENGINES", "HFEngine", "RolloutConfig", "Sample", "VLLMEngine", "build_engine", "iter_hf_weights",
           "resolve_engine", "sync_weights"]
