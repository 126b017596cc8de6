"""Tier a: the trainer's configuration refuses bad values when it is built (before any model is
loaded or rollout sampled), naming the field; NeMo-Run overrides go through the same checks."""

import dataclasses

import pytest
import yaml

from stapo_megatron.config import TrainerConfig
from stapo_megatron.data.config import DataConfig
from stapo_megatron.eval.config import EvalConfig
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.rewards.config import RewardConfig
from stapo_megatron.rollout.config import RolloutSampling
from stapo_megatron.launch.entry import build_config
from stapo_megatron.method.config import LossConfig
from stapo_megatron.mcore.config import OptimConfig

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("cls, field, value, message", [
    (ModelConfig, "tensor_model_parallel_size", 0, "ModelConfig.tensor_model_parallel_size must be >= 1, got 0"),
    (ModelConfig, "pipeline_model_parallel_size", -1, "ModelConfig.pipeline_model_parallel_size must be >= 1"),
    (DataConfig, "max_prompt_len", 0, "DataConfig.max_prompt_len must be >= 1, got 0"),
    (DataConfig, "num_eval", -5, "DataConfig.num_eval must be >= 0, got -5"),
    (RolloutSampling, "group_size", 1, "RolloutSampling.group_size must be >= 2, got 1"),
    (RolloutSampling, "temperature", 0.0, "RolloutSampling.temperature must be finite and > 0, got 0.0"),
    (RolloutSampling, "temperature", NAN, "RolloutSampling.temperature must be finite and > 0, got nan"),
    (RolloutSampling, "temperature", INF, "RolloutSampling.temperature must be finite and > 0, got inf"),
    (RolloutSampling, "top_p", 0.0, r"RolloutSampling.top_p must be in \(0, 1\], got 0.0"),
    (RolloutSampling, "top_p", NAN, r"RolloutSampling.top_p must be in \(0, 1\], got nan"),
    (RolloutSampling, "max_response_len", 0, "RolloutSampling.max_response_len must be >= 1"),
    (RolloutSampling, "gpu_memory_utilization", 1.5, r"gpu_memory_utilization must be in \(0, 1\]"),
    (TrainerConfig, "minibatch_prompts", 0, "TrainerConfig.minibatch_prompts must be >= 1, got 0"),
    (TrainerConfig, "prompts_per_step", 0, "TrainerConfig.prompts_per_step must be >= 1, got 0"),
    (TrainerConfig, "micro_batch_size", 0, "TrainerConfig.micro_batch_size must be >= 1"),
    (EvalConfig, "samples", 0, "EvalConfig.samples must be >= 1"),
    (EvalConfig, "every", -1, "EvalConfig.every must be >= 0"),
    (TrainerConfig, "save_every", -1, "TrainerConfig.save_every must be >= 0"),
    (EvalConfig, "temperature", -0.5, r"eval.temperature must be finite and >= 0 \(0 = greedy\), got -0.5"),
    (EvalConfig, "temperature", NAN, "eval.temperature must be finite and >= 0"),
    (RewardConfig, "timeout_s", 0.0, "reward.timeout_s must be finite and > 0, got 0.0"),
    (RewardConfig, "workers", 0, "RewardConfig.workers must be >= 1, got 0"),
    (EvalConfig, "max_response_len", 0, "EvalConfig.max_response_len must be >= 1, got 0"),
    (TrainerConfig, "init_timeout_s", 0.0, "init_timeout_s must be finite and > 0, got 0.0"),
    (TrainerConfig, "distributed_timeout_s", NAN, "distributed_timeout_s must be finite and > 0, got nan"),
    (OptimConfig, "lr", 0.0, r"OptimConfig.lr must be finite and in \(0.0, inf\), got 0.0"),
    (OptimConfig, "lr", NAN, "OptimConfig.lr must be finite"),
    (OptimConfig, "clip_grad", -1.0, r"OptimConfig.clip_grad must be finite and in \[0.0, inf\), got -1.0"),
    (OptimConfig, "adam_beta2", 1.5, r"OptimConfig.adam_beta2 must be finite and in \[0.0, 1.0\], got 1.5"),
    (OptimConfig, "optimizer", "lion", 'OptimConfig.optimizer must be "adam" or "sgd"'),
])
def test_bad_value_is_refused_naming_the_field(cls, field, value, message):
    with pytest.raises(ValueError, match=message):
        cls(**{field: value})
    # dataclasses.replace (how overrides are applied) runs the same checks
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(cls(), **{field: value})


def test_rollout_and_loss_temperature_must_agree():
    # Sampling at 0.7 while ratios, entropies and S2T use T = 1 would be silently wrong.
    with pytest.raises(ValueError, match=r"rollout.temperature=0.7 but loss.temperature=1.0: .* set both "
                                         r"\(rollout.temperature=0.7 loss.temperature=0.7\)"):
        TrainerConfig(rollout=RolloutSampling(temperature=0.7))
    cfg = TrainerConfig(rollout=RolloutSampling(temperature=0.7), loss=LossConfig(temperature=0.7))
    assert cfg.rollout.temperature == cfg.loss.temperature == 0.7


def test_kl_coef_is_accepted_now_that_the_trainer_builds_a_reference():
    # GRPO's beta: the trainer builds a frozen reference model when kl_coef > 0 (reference.py)
    assert TrainerConfig(loss=LossConfig(method="grpo", kl_coef=0.04)).loss.kl_coef == 0.04


@pytest.mark.parametrize("overrides, message", [
    ({"reward_workers": 4}, "reward_workers is now reward.workers: write reward.workers=4"),
    ({"reward_timeout_s": 2.0}, "reward_timeout_s is now reward.timeout_s: write reward.timeout_s=2.0"),
    ({"reward": "boxed_exact_match"}, "reward is now reward.name: write reward.name='boxed_exact_match'"),
    ({"eval_every": 2}, "eval_every is now eval.every: write eval.every=2"),
    ({"eval_temperature": 1.0}, "eval_temperature is now eval.temperature: write eval.temperature=1.0"),
    ({"eval_samples": 4}, "eval_samples is now eval.samples: write eval.samples=4"),
    ({"eval_max_response_len": 64}, "eval_max_response_len is now eval.max_response_len: write eval.max_response_len=64"),
    ({"eval_sets": "name=a,path=b"}, "eval_sets is now eval.sets: write eval.sets='name=a,path=b'"),
    ({"eval": 3}, r"override eval=3: eval is a section \(EvalConfig\); set its fields, eval.FIELD=VALUE"),
])
def test_the_old_flat_keys_are_refused_naming_the_new_key(overrides, message, tmp_path):
    """On the command line (`build_config`, what every launch calls) and in a config YAML alike."""
    from stapo_megatron.config.yaml_io import load_config

    with pytest.raises(ValueError, match=message):
        build_config("tiny", **overrides)
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"recipe": "tiny", "trainer": overrides}))
    with pytest.raises(ValueError, match=f"{path}: {message}"):
        load_config(str(path))


def test_the_new_sections_take_the_values():
    cfg, _ = build_config("tiny", reward={"name": "boxed_exact_match", "workers": 2, "timeout_s": 3.0},
                          eval={"every": 2, "samples": 3, "max_response_len": 50})
    assert cfg.reward == RewardConfig(name="boxed_exact_match", workers=2, timeout_s=3.0)
    assert (cfg.eval.every, cfg.eval.samples, cfg.eval.temperature, cfg.eval.max_response_len) == (2, 3, 1.0, 50)
    assert cfg.rollout_timeout() == cfg.distributed_timeout_s  # 50 tokens: the collective timeout's floor
    with pytest.raises(ValueError, match=r"TrainerConfig.reward is a RewardConfig section, got 'x': give its name "
                                         r"as reward.name"):
        TrainerConfig(reward="x")


def test_prompt_template_needs_the_question():
    with pytest.raises(ValueError, match=r"DataConfig.prompt_template must contain \{question\}, got 'Solve it'"):
        DataConfig(prompt_template="Solve it")


def test_overrides_are_checked_when_the_config_is_built():

    with pytest.raises(ValueError, match="rollout.temperature=0.7 but loss.temperature=1.0"):
        build_config("tiny", rollout={"temperature": 0.7})
    with pytest.raises(ValueError, match="RolloutSampling.group_size must be >= 2, got 1"):
        build_config("tiny", rollout={"group_size": 1})
    with pytest.raises(ValueError, match=r"tau_p must be in \(0, 1\]"):
        build_config("tiny", loss={"tau_p": 2.0})
    cfg, _ = build_config("tiny", rollout={"temperature": 0.7}, loss={"temperature": 0.7})
    assert cfg.rollout.temperature == cfg.loss.temperature == 0.7


def test_vllm_tp_must_divide_megatron_tp():
    # vLLM TP 4 over Megatron TP 2: one engine would span the ranks of two DP replicas
    with pytest.raises(ValueError, match=r"vLLM TP 4 must divide Megatron TP 2 \(rollout.tensor_parallel_size=4, "
                                         r"model.tensor_model_parallel_size=2\): a vLLM engine must not span two DP"):
        TrainerConfig(model=ModelConfig(tensor_model_parallel_size=2), rollout=RolloutSampling(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="vLLM TP 3 must divide Megatron TP 4"):
        dataclasses.replace(TrainerConfig(model=ModelConfig(tensor_model_parallel_size=4)),
                            rollout=RolloutSampling(tensor_parallel_size=3))
    for tp, vtp in ((4, 4), (4, 2), (4, 1), (2, 1)):
        cfg = TrainerConfig(model=ModelConfig(tensor_model_parallel_size=tp), rollout=RolloutSampling(tensor_parallel_size=vtp))
        assert cfg.rollout.tensor_parallel_size == vtp


def test_rollout_timeout_fits_the_longest_response():
    from stapo_megatron.config.tree import SECONDS_PER_RESPONSE_TOKEN
    from stapo_megatron.recipes import paper

    # the paper: 15,360-token rollouts, 20,480-token evaluation; never below the collective timeout
    assert paper.qwen3_14b().rollout_timeout() == SECONDS_PER_RESPONSE_TOKEN * 20480 == 4096
    assert TrainerConfig().rollout_timeout() == SECONDS_PER_RESPONSE_TOKEN * 15360 > TrainerConfig().distributed_timeout_s
    short = TrainerConfig(rollout=RolloutSampling(max_response_len=64))
    assert short.rollout_timeout() == short.distributed_timeout_s == 600
    assert TrainerConfig(rollout_timeout_s=7200.0).rollout_timeout() == 7200.0
    for bad in (0.0, -1.0, NAN, INF):
        with pytest.raises(ValueError, match=f"rollout_timeout_s must be finite and > 0, got {bad}"):
            TrainerConfig(rollout_timeout_s=bad)


def test_collective_timeout_is_set_for_the_phase_and_restored():
    import torch.distributed as dist

    from stapo_megatron.mcore.parallel import collective_timeout, group_timeout, init_process_group
    from tests.helpers.dist_utils import single_process_env

    with single_process_env():
        init_process_group(init_timeout_s=30.0, timeout_s=600.0, backend="gloo")
        try:
            other = dist.new_group([0], timeout=__import__("datetime").timedelta(seconds=120))
            with collective_timeout(3072.0, [None, other, None]):
                assert group_timeout() == group_timeout(other) == 3072.0
                dist.barrier()
            assert (group_timeout(), group_timeout(other)) == (600.0, 120.0)
        finally:
            dist.destroy_process_group()
