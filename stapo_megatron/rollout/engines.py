"""Which rollout engine a run uses: vLLM (`VLLMEngine`) or transformers (`HFEngine`).

Both have the same interface (``generate``, ``update_weights``, ``sleep``, ``wake_up``,
``shutdown``) and return the same `Sample` objects; the trainer picks one by
``RolloutSampling.engine``.
"""

from __future__ import annotations

import importlib.util

from stapo_megatron.rollout.vllm_engine import RolloutConfig

ENGINES = ("auto", "vllm", "hf")
"""Accepted ``engine`` names; "auto" is vLLM where it is installed, else the HF engine."""


def resolve_engine(engine: str) -> str:
    """"vllm" or "hf" for an ``engine`` name of ENGINES."""
    if engine not in ENGINES:
        raise ValueError(f"rollout engine must be one of {ENGINES}, got {engine!r}")
    if engine == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return engine


def build_engine(engine: str, hf_dir: str, config: RolloutConfig):
    """The engine of that name (ENGINES) for an HF folder."""
    if resolve_engine(engine) == "vllm":
        from stapo_megatron.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(hf_dir, config)
    from stapo_megatron.rollout.hf_engine import HFEngine

    return HFEngine(hf_dir, config)
