"""The configuration tree: `TrainerConfig` composes the components' config dataclasses.

Each component owns its config section and is imported from there (`LossConfig` from
``method/config.py``, `RolloutSampling` from ``rollout/config.py``, ...); ``tree`` composes them into
`TrainerConfig`. This package hands on the two objects a run's configuration is made of,
`TrainerConfig` and `WarmStartConfig` (``train(cfg, warmstart)``; a recipe returns both),
and nothing else. ``parallel_layout`` checks the parallel layout, ``overrides`` applies
``key=value`` overrides, ``yaml_io`` saves and loads a run's config. Importing this package imports
no Megatron, vLLM or transformers module.
"""

from stapo_megatron.config.tree import TrainerConfig  # noqa: F401
from stapo_megatron.trainer.config import WarmStartConfig  # noqa: F401
