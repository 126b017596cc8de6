"""A user's objective module for tests/method/test_objectives.py and docs/extending.md's example:
one objective registered by `register_objective`, one plain builder named only by its dotted path."""

import torch

from stapo_megatron.method.objectives import register_objective

NOT_AN_OBJECTIVE = 3
"""Something a dotted path can name that is neither an `Objective` nor a builder (an error case)."""


@register_objective("reinforce", loss_options=dict(clip_ratio_high=0.4))
def reinforce(config, sequence_ids, sequence_sum, seed):
    """REINFORCE with the ratio: l_t = -r A, no clip."""
    return lambda logprob, old_logprob, advantages, keep: -torch.exp(logprob - old_logprob) * advantages


def sign_only(config, sequence_ids, sequence_sum, seed):
    """l_t = -r sign(A): the advantage's sign alone."""
    return lambda logprob, old_logprob, advantages, keep: -torch.exp(logprob - old_logprob) * advantages.sign()
