"""Tier a: `RewardConfig` refuses what no run can use (no reward name, no worker, a time bound
that is not a positive finite number of seconds) and names the field."""

import math

import pytest

from stapo_megatron.rewards.config import RewardConfig


def test_defaults_are_math_verify_with_one_worker():
    cfg = RewardConfig()
    assert (cfg.name, cfg.workers, cfg.timeout_s) == ("math_verify", 1, 5.0)
    assert RewardConfig(name="boxed_exact_match", workers=4, timeout_s=0.5).workers == 4


@pytest.mark.parametrize("changes, message", [
    (dict(name=""), "reward.name must be a reward's name or dotted path, got ''"),
    (dict(name=None), "reward.name must be a reward's name or dotted path, got None"),
    (dict(workers=0), "RewardConfig.workers must be >= 1, got 0"),
    (dict(timeout_s=0.0), "reward.timeout_s must be finite and > 0, got 0.0"),
    (dict(timeout_s=math.inf), "reward.timeout_s must be finite and > 0, got inf"),
    (dict(timeout_s=math.nan), "reward.timeout_s must be finite and > 0, got nan"),
])
def test_bad_values_name_the_field(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        RewardConfig(**changes)
