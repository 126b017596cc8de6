"""The rollout configs' placement fields: separate placement and its refusals,
each naming the field and its value."""

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


@pytest.mark.parametrize("fields, message", [
    (dict(placement="remote"), "rollout.placement must be one of ('colocated', 'separate'), got 'remote'"),
    (dict(placement="separate"), "rollout.placement='separate' needs rollout.engine_ranks >= 1"),
    (dict(placement="separate", engine_ranks=3, tensor_parallel_size=2),
     "rollout.engine_ranks=3 is not a multiple of rollout.tensor_parallel_size=2"),
    (dict(placement="separate", engine_ranks=1, max_staleness=-1), "RolloutSampling.max_staleness must be >= 0, got -1"),
    (dict(engine_ranks=2), "rollout.engine_ranks=2 needs rollout.placement='separate'"),
    (dict(max_staleness=1), "rollout.max_staleness=1 needs rollout.placement='separate'"),
    (dict(placement="separate", engine_ranks=1, weight_bucket_mb=0), "RolloutSampling.weight_bucket_mb must be >= 1"),
    (dict(placement="separate", engine_ranks=1, partial=True),
     "rollout.partial=True needs rollout.placement='separate' and rollout.max_staleness >= 1"),
    (dict(partial=True), "rollout.partial=True needs rollout.placement='separate'"),
    (dict(placement="separate", engine_ranks=1, max_staleness=1, partial=True, oversample=0.5),
     "rollout.oversample must be >= 1, got 0.5"),
    (dict(oversample=2.0), "rollout.oversample=2.0 needs rollout.partial=True"),
    (dict(mask_stale_tokens=True), "rollout.mask_stale_tokens=True needs rollout.partial=True"),
    (dict(max_token_age=3), "rollout.max_token_age=3 needs rollout.partial=True or rollout.streaming=True"),
    (dict(placement="separate", engine_ranks=1, max_staleness=2, streaming=True, max_token_age=1),
     "rollout.max_token_age=1 must be >= rollout.max_staleness=2"),
    (dict(placement="separate", engine_ranks=1, max_staleness=2, partial=True, max_token_age=1),
     "rollout.max_token_age=1 must be >= rollout.max_staleness=2"),
    (dict(placement="separate", engine_ranks=1, max_staleness=1, partial=True, max_token_age=2, mask_stale_tokens=True),
     "rollout.mask_stale_tokens=True and rollout.max_token_age=2 both bound the tokens' age"),
    (dict(streaming=True), "rollout.streaming=True needs rollout.placement='separate' and rollout.max_staleness >= 1"),
    (dict(placement="separate", engine_ranks=1, streaming=True),
     "rollout.streaming=True needs rollout.placement='separate' and rollout.max_staleness >= 1 (the off-policyness "
     "bound eta; got placement='separate', max_staleness=0)"),
    (dict(placement="separate", engine_ranks=1, max_staleness=2, streaming=True, partial=True),
     "rollout.streaming=True and rollout.partial=True are two ways of keeping the engines busy: set one"),
    (dict(placement="separate", engine_ranks=1, max_staleness=2, streaming=True, engine="hf"),
     "rollout.streaming=True needs an engine that streams (admits and steps requests one decode iteration at a "
     "time: EngineCapabilities.streaming); rollout.engine='hf' does not"),
    (dict(placement="separate", engine_ranks=2, max_staleness=2, streaming=True, tensor_parallel_size=2),
     "rollout.streaming=True needs rollout.tensor_parallel_size=1, got 2"),
    (dict(placement="separate", engine_ranks=1, max_staleness=2, streaming=True, stream_order="fifo"),
     "rollout.stream_order must be one of ('completion', 'admission'), got 'fifo'"),
    (dict(placement="separate", engine_ranks=1, max_staleness=2, streaming=True, weight_load="later"),
     "rollout.weight_load must be one of ('in_flight', 'recompute', 'drain'), got 'later'"),
    (dict(weight_load="drain"), "rollout.weight_load='drain' needs rollout.streaming=True"),
    (dict(stream_reserve_tokens=4096), "rollout.stream_reserve_tokens=4096 needs rollout.streaming=True"),
    (dict(placement="separate", engine_ranks=1, max_staleness=2, streaming=True, stream_reserve_tokens=0),
     "rollout.stream_reserve_tokens must be None or an int >= 1, got 0"),
    (dict(placement="separate", engine_ranks=1, max_staleness=2, streaming=True, stream_reserve_tokens=2.5),
     "rollout.stream_reserve_tokens must be None or an int >= 1, got 2.5"),
])
def test_placement_refusals_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        RolloutSampling(**fields)


def test_the_token_age_bound_is_max_token_age_or_k_with_mask_stale_tokens():
    partial = dict(placement="separate", engine_ranks=1, max_staleness=2, partial=True)
    assert RolloutSampling(**partial).token_age_bound is None
    assert RolloutSampling(**partial, max_token_age=5).token_age_bound == 5
    assert RolloutSampling(**partial, mask_stale_tokens=True).token_age_bound == 2
    streaming = dict(placement="separate", engine_ranks=1, max_staleness=2, streaming=True)
    assert RolloutSampling(**streaming).token_age_bound is None
    assert RolloutSampling(**streaming, max_token_age=3).token_age_bound == 3


def test_separate_placement_counts_its_engines():
    r = RolloutSampling(placement="separate", engine_ranks=4, tensor_parallel_size=2, max_staleness=2)
    assert r.num_engines == 2 and RolloutSampling().num_engines == 0


def test_the_training_ranks_are_the_job_less_its_engine_ranks():
    cfg = TrainerConfig(model=ModelConfig(tensor_model_parallel_size=2), prompts_per_step=8, minibatch_prompts=8,
                        rollout=RolloutSampling(placement="separate", engine_ranks=4))
    assert world_problems(cfg, 8) == []  # 4 training ranks: TP 2 x DP 2
    assert world_problems(cfg, 7) == ["3 GPUs are not divisible by TP 2 x PP 1 x CP 1"]
    assert world_problems(cfg, 4) == ["rollout.engine_ranks=4 leaves no training rank of the job's 4"]
    assert world_problems(cfg, 12, gpus_per_node=4) == []  # 2 nodes train (DP 4), 1 generates
    assert "must be whole nodes of 8 GPUs or divide one" in world_problems(
        TrainerConfig(prompts_per_step=8, minibatch_prompts=8,
                      rollout=RolloutSampling(placement="separate", engine_ranks=12)), 24, gpus_per_node=8)[0]
    # the vLLM engine's TP need not divide Megatron's when the engines have their own ranks
    TrainerConfig(rollout=RolloutSampling(placement="separate", engine_ranks=4, tensor_parallel_size=4))


def test_stale_samples_without_a_behaviour_policy_correction_warn_naming_the_fields():
    separate = dict(placement="separate", engine_ranks=1)
    with pytest.warns(UserWarning, match=r"rollout\.max_staleness=1 with loss\.rollout_correction\.mode='none'"):
        TrainerConfig(rollout=RolloutSampling(**separate, max_staleness=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainerConfig(rollout=RolloutSampling(**separate, max_staleness=0))  # synchronous: the samples are fresh
        TrainerConfig(rollout=RolloutSampling(**separate, max_staleness=1),
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
