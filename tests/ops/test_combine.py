"""Tier a: the TP combination (steps 2-4) on shards' partials, its all-reduces done by hand.

What the MAX and the packed SUM over a TP group compute is taken here as ``max`` and ``+`` over the
shards' tensors, so one process checks the arithmetic; the collectives themselves (exactly two)
are checked on gloo by the multi-process tests (tests/integration/test_triton_path_tp.py,
tests/integration/test_parallel.py).
"""

import torch

from stapo_megatron.ops.combine import normalise, packed_partials, reduce_stats
from stapo_megatron.ops.torch_path import _local_stats

# fp32 sums over 200 terms, rescaled once and normalised: a few ulps of values below 16 (2^-20 each).
TOL = 2**-18


def _shard_partials(logits, target, num_shards, inv_temp):
    vocab_local = logits.shape[-1] // num_shards
    shards = logits.split(vocab_local, dim=-1)
    return [_local_stats(x.contiguous(), target, r * vocab_local, inv_temp, with_collision=True)[0]
            for r, x in enumerate(shards)]


def _by_hand(partials):
    """The MAX over shards, then the SUM of the packed, rescaled rows."""
    global_m = torch.stack([p[0] for p in partials]).amax(0)
    packed = sum(packed_partials(p[0], global_m, *p[1:]) for p in partials)
    return global_m, packed[0], packed[1], packed[2], packed[3]


def test_shards_combine_to_the_full_vocabulary():
    """Four shards of a 800-entry vocabulary, one of them wholly masked in row 2 and holding the
    dominant token of row 3: log Z, log p, H and sum p^2 equal float64 on the whole row."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 800, generator=gen) * 3
    logits[2, 200:400] = float("-inf")  # shard 1 contributes nothing to row 2
    logits[3, 650] = 30.0  # shard 3 holds p ~ 1
    target = torch.tensor([5, 250, 799, 650, 401])
    temperature = 0.7
    log_z, logprob, entropy, collision = normalise(*_by_hand(_shard_partials(logits, target, 4, 1 / temperature)))
    z = logits.double() / temperature
    logp_all = torch.log_softmax(z, -1)
    p = logp_all.exp()
    torch.testing.assert_close(log_z.double(), torch.logsumexp(z, -1), atol=TOL, rtol=0)
    torch.testing.assert_close(logprob.double(), logp_all.gather(-1, target[:, None]).squeeze(-1), atol=TOL, rtol=0)
    torch.testing.assert_close(entropy.double(), -torch.where(p > 0, p * logp_all, 0.0).sum(-1), atol=TOL, rtol=0)
    torch.testing.assert_close(collision.double(), p.square().sum(-1), atol=TOL, rtol=0)


def test_one_shard_is_the_identity_and_the_collision_row_is_optional():
    """Without a TP group the global reference is the local one and nothing is rescaled; leaving
    the collision sum out leaves the other statistics bit for bit as they were."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 300, generator=gen) * 2
    target = torch.tensor([0, 150, 299])
    m, s, w, z_y, q = _shard_partials(logits, target, 1, 1.0)[0]
    with_q = reduce_stats(m, s, w, z_y, q, None)
    without_q = reduce_stats(m, s, w, z_y, None, None)
    for got, want in zip(with_q, (m, s, w, z_y, q)):
        assert torch.equal(got, want)
    assert without_q[4] is None
    for a, b in zip(without_q[:4], with_q[:4]):
        assert torch.equal(a, b)
    assert normalise(*without_q)[3] is None
