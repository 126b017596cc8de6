"""Tier a: overrides, dotted or in sections, go through one parser that names an unknown or
mistyped field (with the closest names) and the warm-start's fields too."""

import pytest

from stapo_megatron.config import TrainerConfig, WarmStartConfig
from stapo_megatron.config.overrides import apply_overrides
from stapo_megatron.launch.entry import build_config


@pytest.mark.parametrize("overrides, message", [
    ({"stepz": 1}, "unknown override stepz: TrainerConfig has no field 'stepz' (did you mean 'steps'?)"),
    ({"loss.tau_pp": 0.1}, "unknown override loss.tau_pp: LossConfig has no field 'tau_pp' (did you mean 'tau_p'?)"),
    ({"rollout": {"max_response": 8}}, "RolloutSampling has no field 'max_response' (did you mean 'max_response_len'?)"),
    ({"optim.zzz": 1}, "unknown override optim.zzz: OptimConfig has no field 'zzz' (fields: lr, "),
    ({"loss.tau_p": "small"}, "override loss.tau_p='small': expected float, got str"),
])
def test_unknown_and_mistyped_overrides_name_the_field(overrides, message):
    with pytest.raises(ValueError) as info:
        apply_overrides(TrainerConfig(), overrides)
    assert message in str(info.value)


def test_one_parser_for_dotted_keys_sections_and_the_warm_start():
    dotted = apply_overrides(TrainerConfig(), {"loss.tau_p": 0.01, "rollout.top_p": 0.9, "steps": 3})
    nested = apply_overrides(TrainerConfig(), {"loss": {"tau_p": 0.01}, "rollout": {"top_p": 0.9}, "steps": 3})
    assert dotted == nested and (dotted.loss.tau_p, dotted.rollout.top_p, dotted.steps) == (0.01, 0.9, 3)
    assert apply_overrides(WarmStartConfig(), {"steps": 7}).steps == 7
    with pytest.raises(ValueError, match=r"unknown override warmstart.stepz: .* \(did you mean 'steps'\?\)"):
        build_config("tiny", warmstart={"stepz": 2})


def test_unchecked_overrides_leave_the_refusal_to_the_caller():
    """``check=False`` skips `TrainerConfig.__post_init__` (which raises the first layout problem),
    so that a recipe's check lists them all; the sections' own checks still run."""
    budget = {"packing": "budget", "max_tokens_per_microbatch": 8}
    with pytest.raises(ValueError, match="max_tokens_per_microbatch 8 < the longest sequence"):
        apply_overrides(TrainerConfig(), budget)
    base = TrainerConfig()
    unchecked = apply_overrides(base, {**budget, "model.tensor_model_parallel_size": 3}, check=False)
    assert (unchecked.max_tokens_per_microbatch, unchecked.model.tensor_model_parallel_size) == (8, 3)
    assert (base.max_tokens_per_microbatch, base.model.tensor_model_parallel_size) == (0, 1)  # a copy
    with pytest.raises(ValueError, match="unknown override model.tp"):
        apply_overrides(base, {"model.tp": 3}, check=False)


def test_none_on_the_command_line_is_the_text_for_a_str_field_and_none_for_an_optional_one():
    """``loss.rollout_correction.mode=none`` reaches the parser as None (the command line reads it
    so): a str field takes its text, an Optional field None."""
    config = apply_overrides(TrainerConfig(), {"loss.rollout_correction.mode": None, "rollout.streaming.max_token_age": None})
    assert config.loss.rollout_correction.mode == "none" and config.rollout.streaming.max_token_age is None
    with pytest.raises(ValueError, match="expected int, got NoneType"):
        apply_overrides(TrainerConfig(), {"steps": None})


def test_an_optional_section_is_turned_on_by_a_field_and_off_by_none():
    from stapo_megatron.config.yaml_io import dump_config, parse_config
    from stapo_megatron.mcore.lora_config import LoraConfig

    assert TrainerConfig().lora is None, "LoRA is off unless asked for"
    on = apply_overrides(TrainerConfig(), {"lora.rank": 8, "lora.target_modules": ["linear_qkv"]})
    assert on.lora == LoraConfig(rank=8, target_modules=["linear_qkv"]), "the other fields keep their defaults"
    assert apply_overrides(TrainerConfig(), {"lora": {"alpha": 4.0}}).lora == LoraConfig(alpha=4.0)
    assert apply_overrides(on, {"lora": None}).lora is None
    assert parse_config(dump_config(on))[1] == on, "the YAML round trip keeps the section"
    with pytest.raises(ValueError, match=r"unknown override lora.rnk: LoraConfig has no field 'rnk' \(did you mean "
                                         r"'rank'\?\)"):
        apply_overrides(TrainerConfig(), {"lora.rnk": 8})
    with pytest.raises(ValueError, match="lora.rank must be a positive integer, got 0"):
        apply_overrides(TrainerConfig(), {"lora.rank": 0})
    with pytest.raises(ValueError, match=r"lora.target_modules: \['q_proj'\] are not adaptable linears"):
        apply_overrides(TrainerConfig(), {"lora.target_modules": ["q_proj"]})
