"""Which rollout engine a run uses: a name of `ENGINES`, each a dotted path imported only when
chosen (vLLM stays optional), plus "auto".

Every engine follows `stapo_megatron.rollout.base.RolloutEngine` and is built as
``Engine(hf_dir, config)``; the trainer picks one by ``RolloutSampling.engine``, ``stapo-eval``
by ``--engine``. A new engine is one line here (and its module).
"""

from __future__ import annotations

import importlib.util

from typing import Any

from stapo_megatron.rollout.base import EngineCapabilities, RolloutEngine
from stapo_megatron.utils import load_dotted

ENGINES = {
    "vllm": "stapo_megatron.rollout.vllm_engine.VLLMEngine",
    "hf": "stapo_megatron.rollout.hf_engine.HFEngine",
    "vllm_lora": "stapo_megatron.rollout.vllm_lora.VLLMLoraEngine",  # vLLM with LoRA: adapter-only sync
}
"""Engine name -> dotted path of its class."""

ENGINE_NAMES = ("auto", *ENGINES)
"""Accepted ``engine`` names; "auto" is vLLM where it is installed, else the HF engine."""


def resolve_engine(engine: str) -> str:
    """The `ENGINES` name an ``engine`` name of `ENGINE_NAMES` stands for."""
    if engine not in ENGINE_NAMES:
        raise ValueError(f"rollout engine must be one of {ENGINE_NAMES}, got {engine!r}")
    if engine == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    return engine


def engine_capabilities(engine: str) -> EngineCapabilities:
    """What the class of ``engine`` (`ENGINE_NAMES`) declares it can do (its ``capabilities``);
    "auto" asks vLLM's, the engine it names wherever vLLM is installed (the engine ranks')."""
    name = "vllm" if engine == "auto" else resolve_engine(engine)
    return load_dotted(ENGINES[name], "rollout.engine").capabilities


def serves_adapters(engine: str) -> bool:
    """Whether the class of ``engine`` takes LoRA adapters apart from the base (its
    ``serves_adapters``: `stapo_megatron.rollout.weight_sync.sync_weights` then sends it the
    adapters alone); the engine ranks' `stapo_megatron.rollout.remote.RemoteEngine` asks."""
    name = "vllm" if engine == "auto" else resolve_engine(engine)
    return getattr(load_dotted(ENGINES[name], "rollout.engine"), "serves_adapters", False)


def build_engine(engine: str, hf_dir: str, config: Any) -> RolloutEngine:
    """The engine of that name (`ENGINE_NAMES`) for an HF folder and a
    `stapo_megatron.rollout.config.RolloutConfig` (not imported: the config asks this module)."""
    return load_dotted(ENGINES[resolve_engine(engine)], "rollout.engine")(hf_dir, config)
