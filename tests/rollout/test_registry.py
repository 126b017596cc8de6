"""Tier a: the rollout engine a config names (vllm, hf, remote, or a dotted path) is the one built;
what each engine class declares it can do, and the config asking that instead of the name."""

import pytest


def test_engine_choice():
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.registry import build_engine, resolve_engine

    assert resolve_engine("hf") == "hf" and resolve_engine("vllm") == "vllm"
    assert resolve_engine("auto") in ("vllm", "hf")
    with pytest.raises(ValueError, match="rollout engine must be one of"):
        resolve_engine("sglang")
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_engine("hf", "/nonexistent", RolloutConfig())


def test_each_engine_declares_its_capabilities_and_streaming_asks_them(monkeypatch):
    from stapo_megatron.rollout import registry
    from stapo_megatron.rollout.base import EngineCapabilities
    from stapo_megatron.rollout.config import RolloutSampling
    from stapo_megatron.rollout.rollout_modes import SeparatePlacement

    assert registry.engine_capabilities("vllm") == EngineCapabilities(True, True, True)
    assert registry.engine_capabilities("hf") == EngineCapabilities(False, True, True)
    assert registry.engine_capabilities("auto") == registry.engine_capabilities("vllm")
    # a newly registered engine without streaming is refused by its own name, not by a list of names
    monkeypatch.setitem(registry.ENGINES, "transformers", registry.ENGINES["hf"])
    monkeypatch.setattr(registry, "ENGINE_NAMES", (*registry.ENGINE_NAMES, "transformers"))
    streaming = dict(mode="streaming", separate=SeparatePlacement(engine_ranks=1, max_staleness=2))
    with pytest.raises(ValueError, match="rollout.engine='transformers' does not: use 'vllm' or 'auto'"):
        RolloutSampling(**streaming, engine="transformers")
    assert RolloutSampling(**streaming, engine="vllm").mode == "streaming"


def test_the_adapter_serving_engine_is_asked_of_its_class():
    """`registry.serves_adapters`: what the separate placement's `RemoteEngine` is told, from the
    engine class's ``serves_adapters`` (the adapter-only sync goes to vllm_lora alone)."""
    from stapo_megatron.rollout.registry import serves_adapters

    assert serves_adapters("vllm_lora") is True
    assert serves_adapters("vllm") is False and serves_adapters("hf") is False
    assert serves_adapters("auto") is False
