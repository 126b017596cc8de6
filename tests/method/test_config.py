"""Tier a: `LossConfig` refuses objective settings it cannot run and names them; the covariance
objectives are refused under context parallelism."""

import pytest

from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.objectives import OBJECTIVES, check_parallelism


@pytest.mark.parametrize("fields, message", [
    (dict(objective="cispoo"), r"objective must be one of \('dapo'.*got 'cispoo' \(did you mean 'cispo'\?\)"),
    (dict(objective="dual_clip"), r"objective='dual_clip' needs clip_ratio_c"),
    (dict(clip_cov_ratio=0.0), r"clip_cov_ratio must be in \(0, 1\]"),
    (dict(kl_cov_ratio=2.0), r"kl_cov_ratio must be in \(0, 1\]"),
    (dict(clip_cov_lower=5.0), r"need clip_cov_lower < clip_cov_upper, got 5.0, 5.0"),
    (dict(kl_cov_coef=float("nan")), r"kl_cov_coef must be finite and >= 0, got nan"),
])
def test_bad_objective_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**fields)


def test_covariance_objectives_are_refused_under_context_parallelism():
    for name, objective in OBJECTIVES.items():
        check_parallelism(name, 1)
        if objective.context_parallel:
            check_parallelism(name, 2)
        else:
            with pytest.raises(ValueError, match=rf"loss.objective='{name}' with model.context_parallel_size=2"):
                check_parallelism(name, 2)
    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.mcore.config import ModelConfig

    with pytest.raises(ValueError, match=r"loss.objective='kl_cov' with model.context_parallel_size=2"):
        TrainerConfig(model=ModelConfig(context_parallel_size=2), packing="fixed", loss=LossConfig(objective="kl_cov"))
    assert TrainerConfig(model=ModelConfig(context_parallel_size=2), packing="fixed",
                         loss=LossConfig(objective="gspo")).loss.objective == "gspo"
