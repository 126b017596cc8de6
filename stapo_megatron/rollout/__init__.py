"""Rollouts: sampling responses in the training processes and keeping the engine's weights current.

- ``base``: the engine contract, `RolloutEngine` (a Protocol), and `Sample`.
- ``spmd``: how the training ranks share one engine's samples (broadcast over the model-parallel
  group, prompts spread over the context-parallel ranks).
- ``registry``: `ENGINES`, engine names -> dotted paths, imported only when chosen (vLLM stays
  optional); `build_engine`, `resolve_engine`.
- ``vllm_engine`` / ``hf_engine``: the in-process vLLM engine and the transformers engine for
  machines without vLLM.
- ``weight_sync``: the Megatron -> engine weight stream after every optimizer step (MoE: experts
  gathered over expert-TP and EP, so every engine holds every expert).
- Mixture-of-experts: an engine asked to (``RolloutConfig.return_routed_experts``) returns the
  experts it routed each token to (``Sample.routed_experts``); `stapo_megatron.trainer.routing`
  compares them with Megatron's routing (the routing-disagreement metrics).
- ``transport`` / ``remote``: separate placement: the process groups between the trainer and engine
  transport and their messages; `RemoteEngine`, the engines on their own ranks seen from the trainers
  (what runs on an engine rank is the ``stapo_megatron.serve`` wing).
- ``config``: `EngineResources`, the engine's `RolloutConfig`, the trainer's `RolloutSampling` and
  `SamplingSettings` (n, temperature, top-p, max tokens, seed: what one request samples with).

A new engine touches ``registry.py`` (one line) and its own module. Importing this package does
not import vllm or megatron-core.
"""
