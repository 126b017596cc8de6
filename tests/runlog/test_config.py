"""Tier a: `LoggingConfig`: the command line's spellings of the tracking backends, and the values
it refuses with the field named."""

import pytest

from stapo_megatron.runlog.config import TRACKING_BACKENDS, LoggingConfig


@pytest.mark.parametrize("backends, parsed", [
    ("[tensorboard,wandb,mlflow]", ("tensorboard", "wandb", "mlflow")),
    ("wandb, mlflow", ("wandb", "mlflow")),
    ("(tensorboard)", ("tensorboard",)),
    ("", ()),
    (["mlflow"], ("mlflow",)),
])
def test_backends_from_the_command_line_or_a_list(backends, parsed):
    assert LoggingConfig(backends=backends).backends == parsed


def test_defaults_log_to_tensorboard_offline():
    cfg = LoggingConfig()
    assert cfg.backends == ("tensorboard",) and cfg.wandb_mode == "offline" and cfg.num_samples == 8
    assert set(cfg.backends) <= set(TRACKING_BACKENDS)


@pytest.mark.parametrize("changes, message", [
    (dict(backends="tensorboard,comet"), "logging.backends: unknown ['comet']; choose from "
                                         "['tensorboard', 'wandb', 'mlflow']"),
    (dict(wandb_mode="disabled"), "logging.wandb_mode must be 'offline' or 'online', got 'disabled'"),
    (dict(num_samples=-1), "LoggingConfig.num_samples must be >= 0, got -1"),
])
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(ValueError) as info:
        LoggingConfig(**changes)
    assert str(info.value) == message
