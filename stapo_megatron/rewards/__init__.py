"""Rewards: scoring responses against reference answers.

- ``answers``: the last ``\\boxed{}`` of a response and the math-verify reward (`score_response`).
- ``functions``: the reward registry `REWARDS` (math-verify, the paper's boxed exact match with
  Minerva's normalisation) and user reward functions by dotted path.
- ``scorer``: `RewardScorer`, the time-bounded pool of worker processes that runs a reward.
- ``config``: `RewardConfig`, the trainer's ``reward`` section (name, workers, timeout).
"""
