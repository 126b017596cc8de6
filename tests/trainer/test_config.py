"""Tier a: `WarmStartConfig`: no warm-start by default, and the values it refuses with the field
named."""

import pytest

from stapo_megatron.trainer.config import WarmStartConfig


def test_default_is_no_warm_start_with_the_boxed_answer_as_target():
    cfg = WarmStartConfig()
    assert cfg.steps == 0 and cfg.label_smoothing == 0.0 and cfg.seed is None
    assert cfg.target_template.format(answer="42") == "\\boxed{42}"


@pytest.mark.parametrize("changes, message", [
    (dict(steps=-1), "WarmStartConfig.steps must be >= 0, got -1"),
    (dict(prompts_per_step=0), "WarmStartConfig.prompts_per_step must be >= 1, got 0"),
    (dict(label_smoothing=1.0), "warmstart.label_smoothing must be in [0, 1), got 1.0"),
    (dict(label_smoothing=-0.1), "warmstart.label_smoothing must be in [0, 1), got -0.1"),
])
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(ValueError) as info:
        WarmStartConfig(**changes)
    assert str(info.value) == message
