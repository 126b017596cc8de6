"""Recipes: functions that return a fully populated training configuration.

- ``tiny``: the embedded CPU default (``tiny_demo``), its MoE and Qwen3.5 variants (``tiny_moe_demo``,
  ``tiny_qwen35_demo``) and the CPU method comparison.
- ``paper``: the paper's Qwen3-1.7B/8B/14B-Base setups (JustRL + S2T) with their parallel layouts.
- ``synthetic``: a tiny GPTModel (from `bridge.tiny`'s spec) and synthetic rollouts for the demo,
  benchmarks and tests (no checkpoint).
"""

from stapo_megatron.recipes.tiny import prepare_tiny_model, tiny_compare, tiny_demo, tiny_moe_demo  # noqa: F401
