"""Tier a: the rollout engine a config names (vllm, hf, remote, or a dotted path) is the one built."""

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
