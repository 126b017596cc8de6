"""Tier a: `DataConfig`: the held-out file's field mapping falls back to the training file's field
by field, and what no run can use is refused with the field named."""

import pytest

from stapo_megatron.data.config import DataConfig


def test_held_out_fields_fall_back_to_the_training_files():
    cfg = DataConfig(prompt_field="question", answer_field="reward_model.ground_truth")
    assert cfg.training_fields() == dict(prompt_field="question", answer_field="reward_model.ground_truth")
    assert cfg.held_out_fields() == cfg.training_fields()
    own = DataConfig(prompt_field="question", eval_prompt_field="problem", eval_answer_field="")
    # "" is the plain `answer` field, not "unset": it does not fall back
    assert own.held_out_fields() == dict(prompt_field="problem", answer_field="")


@pytest.mark.parametrize("changes, message", [
    (dict(num_train=-1), "DataConfig.num_train must be >= 0, got -1"),
    (dict(num_eval=-2), "DataConfig.num_eval must be >= 0, got -2"),
    (dict(max_prompt_len=0), "DataConfig.max_prompt_len must be >= 1, got 0"),
    (dict(prompt_template="Solve: {q}"), "DataConfig.prompt_template must contain {question}, got 'Solve: {q}'"),
])
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(ValueError) as info:
        DataConfig(**changes)
    assert str(info.value) == message
