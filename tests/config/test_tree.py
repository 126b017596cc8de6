"""The configuration tree: each component owns its config dataclass, the tree composes them, one parser
applies overrides."""

import dataclasses
import importlib

import pytest

from stapo_megatron import config
from stapo_megatron.config import TrainerConfig
from stapo_megatron.config.tree import field_docs
from stapo_megatron.rollout.config import EngineResources, RolloutConfig, RolloutSampling


SECTIONS = [
    ("LossConfig", "method"), ("ModelConfig", "mcore"), ("OptimConfig", "mcore"), ("DataConfig", "data"),
    ("EvalConfig", "eval"), ("EvalSetConfig", "eval"), ("EngineResources", "rollout"), ("RolloutConfig", "rollout"),
    ("RolloutSampling", "rollout"), ("LoggingConfig", "runlog"), ("WarmStartConfig", "trainer"),
    ("RewardConfig", "rewards"),
]
"""Every config section and the wing that owns it (imported from there: ``stapo_megatron.config``
hands on only the two objects of a run's configuration, `TrainerConfig` and `WarmStartConfig`)."""


def _section(name, owner):
    return getattr(importlib.import_module(f"stapo_megatron.{owner}.config"), name)


@pytest.mark.parametrize("name, owner", SECTIONS)
def test_every_config_lives_with_its_component_and_the_tree_composes_them(name, owner):
    assert _section(name, owner).__module__ == f"stapo_megatron.{owner}.config"
    assert TrainerConfig.__module__ == "stapo_megatron.config.tree"
    assert hasattr(config, name) == (name == "WarmStartConfig")  # no section re-exported


@pytest.mark.parametrize("name, owner", SECTIONS + [("TrainerConfig", None)])
def test_every_field_has_a_docstring(name, owner):
    docs = field_docs(_section(name, owner) if owner else TrainerConfig)
    assert docs and all(docs.values()), [f for f, d in docs.items() if not d]


def test_engine_fields_are_declared_once():
    shared = {f.name for f in dataclasses.fields(EngineResources)}
    # vllm_model_runner_v2: the trainer asks vLLM for routed experts (router replay) only with V2
    assert shared == {"tensor_parallel_size", "gpu_memory_utilization", "vllm_model_runner_v2"}
    assert issubclass(RolloutSampling, EngineResources) and issubclass(RolloutConfig, EngineResources)
    sampling = RolloutSampling(tensor_parallel_size=4, gpu_memory_utilization=0.4, vllm_model_runner_v2=True)
    engine = sampling.engine_config(max_model_len=64, seed=3)
    assert (engine.tensor_parallel_size, engine.gpu_memory_utilization, engine.max_model_len, engine.seed) == (4, 0.4, 64, 3)
    assert engine.vllm_model_runner_v2
    with pytest.raises(ValueError, match=r"RolloutConfig.gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        RolloutConfig(gpu_memory_utilization=1.5)


def test_the_adapter_syncing_engine_needs_dense_lora_adapters():
    from stapo_megatron.config.overrides import apply_overrides

    with pytest.raises(ValueError, match=r"rollout.engine='vllm_lora' syncs LoRA adapters, but lora is None"):
        apply_overrides(TrainerConfig(), {"rollout.engine": "vllm_lora"})
    with pytest.raises(ValueError, match=r"got lora.experts=True, model.pipeline_model_parallel_size=1: use "
                                         r"rollout.engine='vllm'"):
        apply_overrides(TrainerConfig(), {"rollout.engine": "vllm_lora", "lora.experts": True,
                                          "lora.target_modules": ["linear_fc1"]})
    with pytest.raises(ValueError, match=r"rollout.mode='streaming' needs an engine that streams .* rollout.engine="
                                         r"'vllm_lora' does not"):
        apply_overrides(TrainerConfig(), {"rollout.engine": "vllm_lora", "lora.rank": 8, "rollout.mode": "streaming",
                                          "rollout.separate.engine_ranks": 1, "rollout.separate.max_staleness": 1,
                                          "loss.rollout_correction.mode": "tis"})
    assert apply_overrides(TrainerConfig(), {"rollout.engine": "vllm_lora", "lora.rank": 8}).lora.rank == 8
    for mode, staleness in (("separate", 0), ("partial", 1)):  # the engine ranks load the adapters sent them
        cfg = apply_overrides(TrainerConfig(), {"rollout.engine": "vllm_lora", "lora.rank": 8, "rollout.mode": mode,
                                                "rollout.separate.engine_ranks": 1,
                                                "rollout.separate.max_staleness": staleness,
                                                "loss.rollout_correction.mode": "tis"})
        assert cfg.rollout.mode == mode
