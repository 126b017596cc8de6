"""`LossConfig`: the method's name and constants (defaults: the paper's STAPO recipe)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from stapo_megatron.method.objectives import get_objective
from stapo_megatron.method.registry import get_method
from stapo_megatron.method.rollout_correction import S2T_PROBABILITY_SOURCES, RolloutCorrectionConfig

@dataclasses.dataclass
class LossConfig:
    """Policy-loss method and constants (defaults: the paper's STAPO recipe)."""

    method: str = "stapo"
    """A name of `stapo_megatron.method.registry.METHODS`: "stapo" (S2T mask), "justrl" (the JustRL/DAPO
    objective, no mask), "grpo" (DeepSeekMath GRPO: per-sequence mean, KL to a frozen reference;
    give it its options with `stapo_megatron.method.config.method_loss_config`), "entropy20" (keep
    only the top-20% entropy tokens), "random" (silence as many S2T candidates, drawn at random,
    as S2T would), "random_uniform" (as many random response tokens); or the dotted path of a
    user method, ``pkg.module:fn`` or ``pkg.module.fn`` (a mask function, decorated with
    `stapo_megatron.method.registry.register_method` or plain; docs/extending.md)."""
    clip_ratio_low: float = 0.2
    """eps_low of the clipped ratio (PPO/DAPO)."""
    clip_ratio_high: float = 0.28
    """eps_high of the clipped ratio (DAPO clip-higher)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip constant c > 1 for negative advantages (None = off; the paper recipes, on
    veRL/JustRL, use 10)."""
    kl_coef: float = 0.0
    """beta of a k3 KL(pi_theta || pi_ref) penalty per kept token (GRPO: 0.04; 0 for STAPO and
    JustRL). > 0 makes the trainer build a frozen reference model from the initial weights and
    run one no-grad forward per step (``stapo_megatron.mcore.reference``)."""
    tau_p: float = 0.002
    """S2T probability threshold: candidates have p < tau_p."""
    entropy_quantile: float = 0.75
    """S2T q: tau_H is this quantile of candidate entropies over the mini-batch."""
    entropy_top_fraction: float = 0.2
    """20-Entropy rho: fraction of highest-entropy response tokens kept."""
    tau_h_source: str = "old"
    """Where the mini-batch threshold comes from: "exact" (a no-grad pre-pass with the current
    weights before each mini-batch: Algorithm 1, the paper recipes' setting) or "old" (the pi_old
    pass of the step: exact for the first mini-batch, an approximation for the later ones that
    costs no extra forward; see benchmarks/RESULTS.md for the measured cost and difference)."""
    temperature: float = 1.0
    """Rollout sampling temperature; logits are divided by it exactly as the sampler does."""
    seed: int = 0
    """Base seed of the random-control mask (combined with a per-micro-batch seed)."""
    s2t_probability: str = "trainer"
    """Which probability S2T's candidate test p < tau_p reads (stapo and the random controls):
    "trainer" (the paper's: the trainer's current policy) or "rollout" (the sampler's
    pi_rollout, so that a run shows how much of the silenced set is rollout/training mismatch).
    Entropies, and so tau_H's values, are the trainer's either way."""
    rollout_correction: RolloutCorrectionConfig = dataclasses.field(default_factory=RolloutCorrectionConfig)
    """Rollout/training mismatch: the bounds that flag tokens (logged every step) and the
    correction (`stapo_megatron.method.rollout_correction`; off in the paper's synchronous recipes,
    "tis" in the asynchronous ones: docs/async.md)."""
    objective: Optional[str] = None
    """The objective the method's mask applies to, a name of
    `stapo_megatron.method.objectives.OBJECTIVES`: "dapo" (the JustRL/DAPO token loss), "grpo",
    "dual_clip", "gspo", "cispo", "clip_cov", "kl_cov"; or the dotted path of a user objective,
    ``pkg.module:fn`` (a token-loss builder, decorated with
    `stapo_megatron.method.objectives.register_objective` or plain; docs/extending.md). None: the
    method's own (`Method.objective`: "grpo" for grpo, "dapo" for the others). The objective's
    recipe values (GSPO's clip range, GRPO's KL) come with ``method_loss_config(..., objective=...)``,
    not with this field alone."""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: fraction of the micro-batch's kept tokens that lose their gradient (verl's default)."""
    clip_cov_lower: float = 1.0
    """Clip-Cov: tokens are eligible when lower < cov < upper (verl's clip_cov_lb)."""
    clip_cov_upper: float = 5.0
    """Clip-Cov: the upper covariance bound (verl's clip_cov_ub)."""
    kl_cov_ratio: float = 2e-4
    """KL-Cov: fraction of the micro-batch's kept tokens given the |log r| penalty (verl's default)."""
    kl_cov_coef: float = 1.0
    """KL-Cov: the penalty's coefficient (verl's ppo_kl_coef)."""

    def __post_init__(self):
        get_method(self.method)  # ValueError naming the methods
        self._check_objective()
        if self.s2t_probability not in S2T_PROBABILITY_SOURCES:
            raise ValueError(f"s2t_probability must be one of {S2T_PROBABILITY_SOURCES}, got {self.s2t_probability!r}")
        if self.tau_h_source not in ("old", "exact"):
            raise ValueError(f"tau_h_source must be 'old' or 'exact', got {self.tau_h_source!r}")
        if not (0 <= self.clip_ratio_low < 1 and self.clip_ratio_high >= 0):
            raise ValueError(
                f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got "
                f"{self.clip_ratio_low}, {self.clip_ratio_high}"
            )
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1, got {self.clip_ratio_c}")
        # `not (a < x <= b)` also refuses NaN, which every comparison fails.
        if not 0 < self.tau_p <= 1:
            raise ValueError(f"tau_p must be in (0, 1] (a probability threshold), got {self.tau_p}")
        if not 0 < self.entropy_quantile < 1:
            raise ValueError(f"entropy_quantile must be in (0, 1), got {self.entropy_quantile}")
        if not 0 < self.entropy_top_fraction <= 1:
            raise ValueError(f"entropy_top_fraction must be in (0, 1], got {self.entropy_top_fraction}")
        if not (0 < self.temperature and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be finite and > 0, got {self.temperature}")
        if not (0 <= self.kl_coef and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef must be finite and >= 0, got {self.kl_coef}")

    def _check_objective(self) -> None:
        objective = get_objective(self.effective_objective)  # ValueError naming the objectives
        if objective.name == "dual_clip" and self.clip_ratio_c is None:
            raise ValueError("objective='dual_clip' needs clip_ratio_c (the dual-clip constant c > 1; verl uses 3.0)")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1] (a fraction of tokens), got {getattr(self, name)}")
        if not self.clip_cov_lower < self.clip_cov_upper:
            raise ValueError(f"need clip_cov_lower < clip_cov_upper, got {self.clip_cov_lower}, {self.clip_cov_upper}")
        if not (0 <= self.kl_cov_coef and math.isfinite(self.kl_cov_coef)):
            raise ValueError(f"kl_cov_coef must be finite and >= 0, got {self.kl_cov_coef}")

    @property
    def effective_objective(self) -> str:
        """``objective``, or the method's own when None."""
        return self.objective if self.objective is not None else get_method(self.method).objective


def method_loss_config(method: str, objective: Optional[str] = None, **shared: Any) -> LossConfig:
    """The `LossConfig` of ``method`` (on ``objective``, None: the method's own): the ``shared``
    field values, then the method's own ``loss_options`` (GRPO's symmetric clip and KL
    coefficient), then the named objective's (GSPO's clip range, dual-clip's c)."""
    options = {**shared, **get_method(method).loss_options}
    if objective is not None:
        options.update(get_objective(objective).loss_options, objective=objective)
    return LossConfig(method=method, **options)
