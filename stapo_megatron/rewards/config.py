"""`RewardConfig`: which reward function scores the rollouts, and the worker processes that run it
(`stapo_megatron.rewards.scorer.RewardScorer`). The trainer's ``reward`` section
(``reward.name=boxed_exact_match reward.workers=4``)."""

from __future__ import annotations

import dataclasses
import math

from stapo_megatron.utils import check_at_least


@dataclasses.dataclass
class RewardConfig:
    """The reward of a run (the paper recipes: ``boxed_exact_match``)."""

    name: str = "math_verify"
    """The reward function: a name of `stapo_megatron.rewards.functions.REWARDS` ("math_verify": 1/0 by
    math-verify equivalence; "boxed_exact_match": +1/-1 by normalised exact match of the last
    \\boxed{}, the paper's rule-based reward) or the dotted path of a module-level function
    ``(response, answer) -> (reward, status)`` (e.g. a model-based verifier; docs/data.md, "Rewards")."""
    timeout_s: float = 5.0
    """Time bound (CPU seconds of a worker) of one reward check."""
    workers: int = 1
    """Reward worker processes (`RewardScorer.num_workers`)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"reward.name must be a reward's name or dotted path, got {self.name!r}")
        check_at_least(self, 1, "workers")
        if not (0 < self.timeout_s and math.isfinite(self.timeout_s)):
            raise ValueError(f"reward.timeout_s must be finite and > 0, got {self.timeout_s}")
