"""The rollout configs: the rollout mode and its sections (`stapo_megatron.rollout.rollout_modes`)
with their refusals, each naming the field and its value, and the sampling settings."""

import dataclasses
import pickle
import warnings

import pytest

from stapo_megatron.config import TrainerConfig
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.config.parallel_layout import world_problems
from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.rollout_correction import RolloutCorrectionConfig
from stapo_megatron.rollout.config import RolloutSampling, SamplingSettings
from stapo_megatron.rollout.rollout_modes import PartialRollouts, SeparatePlacement, StreamingRollouts


def sep(engine_ranks: int = 1, max_staleness: int = 0, **fields) -> dict:
    """A separate mode's fields: ``mode`` (default "separate") and its ``rollout.separate`` section."""
    return dict(mode=fields.pop("mode", "separate"), separate=SeparatePlacement(engine_ranks, max_staleness), **fields)


@pytest.mark.parametrize("fields, message", [
    (dict(mode="remote"), "rollout.mode must be one of ('colocated', 'separate', 'partial', 'streaming'), got 'remote'"),
    (dict(mode="separate"), "rollout.mode='separate' needs rollout.separate.engine_ranks >= 1"),
    (sep(3, tensor_parallel_size=2), "rollout.separate.engine_ranks=3 is not a multiple of rollout.tensor_parallel_size=2"),
    (dict(separate=SeparatePlacement(engine_ranks=2)),
     "rollout.separate.engine_ranks=2 needs rollout.mode=one of ('separate', 'partial', 'streaming')"),
    (dict(separate=SeparatePlacement(max_staleness=1)), "rollout.separate.max_staleness=1 needs rollout.mode=one of"),
    (sep(1, mode="partial"), "rollout.mode='partial' needs rollout.separate.max_staleness >= 1"),
    (dict(partial=PartialRollouts(oversample=2.0)), "rollout.partial.oversample=2.0 needs rollout.mode='partial'"),
    (dict(partial=PartialRollouts(max_token_age=3)), "rollout.partial.max_token_age=3 needs rollout.mode='partial'"),
    (sep(1, 2, mode="partial", streaming=StreamingRollouts(max_token_age=3)),
     "rollout.streaming.max_token_age=3 needs rollout.mode='streaming' (rollout.mode='partial' does not read"),
    (sep(1, 2, mode="streaming", streaming=StreamingRollouts(max_token_age=1)),
     "rollout.streaming.max_token_age=1 must be >= rollout.separate.max_staleness=2"),
    (sep(1, 2, mode="partial", partial=PartialRollouts(max_token_age=1)),
     "rollout.partial.max_token_age=1 must be >= rollout.separate.max_staleness=2"),
    (sep(1, mode="streaming"),
     "rollout.mode='streaming' needs rollout.separate.max_staleness >= 1 (the off-policyness bound eta), got 0"),
    (sep(1, 2, mode="streaming", engine="hf"),
     "rollout.mode='streaming' needs an engine that streams (admits and steps requests one decode iteration at a "
     "time: EngineCapabilities.streaming); rollout.engine='hf' does not"),
    (sep(2, 2, mode="streaming", tensor_parallel_size=2), "rollout.mode='streaming' needs rollout.tensor_parallel_size=1, got 2"),
    (dict(streaming=StreamingRollouts(weight_load="drain")),
     "rollout.streaming.weight_load='drain' needs rollout.mode='streaming'"),
    (dict(streaming=StreamingRollouts(reserve_tokens=4096)),
     "rollout.streaming.reserve_tokens=4096 needs rollout.mode='streaming'"),
    (dict(streaming=True), "rollout.streaming is a section (StreamingRollouts), got True: write rollout.mode='streaming'"),
])
def test_mode_refusals_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        RolloutSampling(**fields)


def test_the_token_age_bound_is_the_modes_max_token_age():
    assert RolloutSampling(**sep(1, 2, mode="partial")).token_age_bound is None
    assert RolloutSampling(**sep(1, 2, mode="partial", partial=PartialRollouts(max_token_age=5))).token_age_bound == 5
    assert RolloutSampling(**sep(1, 2, mode="streaming")).token_age_bound is None
    streaming = RolloutSampling(**sep(1, 2, mode="streaming", streaming=StreamingRollouts(max_token_age=3)))
    assert streaming.token_age_bound == 3 and streaming.pooled and streaming.placement == "separate"
    assert RolloutSampling().token_age_bound is None and RolloutSampling().placement == "colocated"


def test_separate_modes_count_their_engines():
    r = RolloutSampling(**sep(4, 2, tensor_parallel_size=2))
    assert r.num_engines == 2 and RolloutSampling().num_engines == 0
    assert r.max_staleness == 2 and not r.pooled


def test_the_training_ranks_are_the_job_less_its_engine_ranks():
    cfg = TrainerConfig(model=ModelConfig(tensor_model_parallel_size=2), prompts_per_step=8, minibatch_prompts=8,
                        rollout=RolloutSampling(**sep(4)))
    assert world_problems(cfg, 8) == []  # 4 training ranks: TP 2 x DP 2
    assert world_problems(cfg, 7) == ["3 GPUs are not divisible by TP 2 x PP 1 x CP 1"]
    assert world_problems(cfg, 4) == ["rollout.separate.engine_ranks=4 leaves no training rank of the job's 4"]
    assert world_problems(cfg, 12, gpus_per_node=4) == []  # 2 nodes train (DP 4), 1 generates
    assert "must be whole nodes of 8 GPUs or divide one" in world_problems(
        TrainerConfig(prompts_per_step=8, minibatch_prompts=8, rollout=RolloutSampling(**sep(12))), 24,
        gpus_per_node=8)[0]
    # the vLLM engine's TP need not divide Megatron's when the engines have their own ranks
    TrainerConfig(rollout=RolloutSampling(**sep(4, tensor_parallel_size=4)))


def test_stale_samples_without_a_behaviour_policy_correction_warn_naming_the_fields():
    with pytest.warns(UserWarning, match=r"rollout\.separate\.max_staleness=1 with loss\.rollout_correction\.mode='none'"):
        TrainerConfig(rollout=RolloutSampling(**sep(1, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainerConfig(rollout=RolloutSampling(**sep(1, 0)))  # synchronous: the samples are fresh
        TrainerConfig(rollout=RolloutSampling(**sep(1, 1)),
                      loss=LossConfig(rollout_correction=RolloutCorrectionConfig(mode="tis")))


def test_a_steps_sampling_settings_are_one_frozen_value_whose_shares_keep_their_seeds():
    """`RolloutSampling.settings` gives what a step samples with; a share of the request after its
    first prompts keeps the seeds it has in the whole request (prompt i's j-th sample: seed + i n + j)."""
    settings = RolloutSampling(group_size=4, temperature=0.7, top_p=0.9, max_response_len=32).settings(seed=100)
    assert settings == SamplingSettings(n=4, temperature=0.7, top_p=0.9, max_tokens=32, seed=100)
    assert settings.skip(3).seed == 112 and settings.skip(0) == settings
    assert SamplingSettings(2, 1.0, 1.0, 8).skip(5).seed is None  # the engine's own generator
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seed = 1
    assert pickle.loads(pickle.dumps(settings)) == settings  # as it crosses the engines' command queue


@pytest.mark.parametrize("fields, message", [
    (dict(n=0), "n \\(0\\) and SamplingSettings.max_tokens \\(8\\) must be >= 1"),
    (dict(max_tokens=0), "max_tokens \\(0\\) must be >= 1"),
    (dict(temperature=-1.0), "temperature >= 0 and 0 < top_p <= 1, got temperature=-1.0"),
    (dict(top_p=0.0), "got temperature=1.0, top_p=0.0"),
])
def test_bad_sampling_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingSettings(**{**dict(n=2, temperature=1.0, top_p=1.0, max_tokens=8), **fields})
