"""The configuration tree: `TrainerConfig` composes the components' config dataclasses.

Each component owns its config (`LossConfig` in ``method/config.py``, `RolloutSampling` in
``rollout/config.py``, ...); ``tree`` composes them, ``overrides`` applies ``key=value``
overrides, ``yaml_io`` saves and loads a run's config. Importing this package imports no
Megatron, vLLM or transformers module.
"""

from stapo_megatron.config.tree import (  # noqa: F401
    DataConfig, EngineResources, EvalConfig, EvalSetConfig, LoggingConfig, LossConfig, ModelConfig, OptimConfig,
    RewardConfig, RolloutConfig, RolloutSampling, TrainerConfig, WarmStartConfig, eval_set_configs, field_docs,
)
from stapo_megatron.config.tree import __all__  # noqa: F401
