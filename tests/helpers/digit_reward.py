"""A dense reward for short trainer runs of an untrained character model, which never writes a
correct ``\\boxed{}`` answer (math rewards would all be 0, every group flat, every update empty):
+1 when the response starts with a digit (about 1 in 10 of its first tokens), else 0, so most
groups of 8 samples hold both and STAPO has advantages to learn from."""

from stapo_megatron.rewards.answers import STATUS_OK


def starts_with_digit(response: str, answer: str):
    """(1.0 if the response's first character is a digit else 0.0, ``STATUS_OK``)."""
    return (1.0 if response[:1].isdigit() else 0.0), STATUS_OK
