"""Rollouts: sampling responses in the training processes and keeping the engine's weights current.

- ``base``: the engine contract, `RolloutEngine` (a Protocol), and `Sample`.
- ``registry``: `ENGINES`, engine names -> dotted paths, imported only when chosen (vLLM stays
  optional); `build_engine`, `resolve_engine`.
- ``vllm_engine`` / ``hf_engine``: the in-process vLLM engine and the transformers engine for
  machines without vLLM.
- ``weight_sync``: the Megatron -> engine weight stream after every optimizer step.
- ``config``: `EngineResources`, the engine's `RolloutConfig` and the trainer's `RolloutSampling`.

A new engine touches ``registry.py`` (one line) and its own module. Importing this package does
not import vllm or megatron-core.
"""
