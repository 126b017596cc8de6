"""A user's method module for tests/method/test_registry.py and docs/extending.md's example: one
method registered by `register_method`, one plain mask function named only by its dotted path."""

from stapo_megatron.method.registry import register_method

NOT_A_METHOD = 3
"""Something a dotted path can name that is neither a `Method` nor a mask (an error case)."""


@register_method("positive_only", loss_options=dict(clip_ratio_high=0.2))
def positive_only(config, logprob, entropy, advantages, response_mask, threshold, seed):
    """Silence every token of a below-mean response (A < 0)."""
    return response_mask & (advantages < 0)


def silence_first_response_token(config, logprob, entropy, advantages, response_mask, threshold, seed):
    """Silence the first response token of every sequence."""
    first = response_mask & ~response_mask.roll(1, dims=-1)
    first[..., 0] = response_mask[..., 0]
    return first
