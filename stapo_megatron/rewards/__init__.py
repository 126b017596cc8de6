"""Rewards: scoring responses against reference answers.

- ``scorer``: `RewardScorer` (worker processes, CPU-time limits) and the math-verify reward.
- ``functions``: the reward registry `REWARDS` and user reward functions by dotted path.
- ``config``: `RewardConfig`, the trainer's ``reward`` section (name, workers, timeout).
"""
