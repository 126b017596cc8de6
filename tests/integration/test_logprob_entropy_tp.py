"""Tier b: the op at the Qwen3 and Qwen3.5 vocabularies split over TP = 2 on gloo, each rank's shard
of the output layer padded as the bridge pads it, against the float64 full-vocabulary reference
(values on every rank, and the gradient of the concatenated shards). The inputs and the
tolerances, with their derivation, are ``tests/helpers/dominant_logits.py``'s; TP = 1 is
``tests/ops/test_logprob_entropy.py``."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist_utils import run_distributed
from tests.helpers.dominant_logits import (BF16_GRAD_TOL, ENTROPY_TOL, GRAD_TOL, LOGPROB_TOL, TEMPERATURES, VOCABS,
                                           check_inputs, dominant_inputs, padded_logits, reference)

pytestmark = pytest.mark.slow

TP = 2
DTYPES = (torch.float32, torch.bfloat16)


def _upstream():
    return torch.randn(2, 4, generator=torch.Generator().manual_seed(1))


def _tp_worker(vocab):
    """One TP rank: its shard of the padded logits, forward and backward for every dtype and temperature."""
    import torch.distributed as dist

    from stapo_megatron.bridge.transformer_config import padded_vocab_size
    from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    padded = padded_vocab_size(vocab, world)
    out = {}
    for dtype in DTYPES:
        for temperature in TEMPERATURES:
            logits, target = dominant_inputs(dtype, temperature, vocab)
            shard = padded_logits(logits, padded).chunk(world, dim=-1)[rank].clone().requires_grad_()
            logprob, entropy = vocab_parallel_logprob_entropy(
                shard, target, tp_group=dist.group.WORLD, temperature=temperature, vocab_size=vocab)
            logprob.backward(_upstream())
            out[dtype, temperature] = logprob.detach(), entropy, shard.grad
    return padded, out


@pytest.mark.parametrize("vocab", list(VOCABS.values()), ids=list(VOCABS))
def test_tp2_matches_float64_reference(vocab):
    """Qwen3's 151,936 ids are padded to 152,064 at TP = 2 (rank 1's shard ends in 128 zero logits
    the op must exclude); Qwen3.5's 248,320 split evenly, 124,160 a rank. The tolerances are TP = 1's:
    the split changes only the order of the fp32 sums (two partial sums rescaled once to the
    global maximum), not the magnitudes the bounds are derived from."""
    results = run_distributed(TP, _tp_worker, vocab)
    padded = results[0][0]
    assert padded == {151936: 152064, 248320: 248320}[vocab]
    for dtype in DTYPES:
        for temperature in TEMPERATURES:
            logits, target = dominant_inputs(dtype, temperature, vocab)
            x, ref_lp, ref_h = reference(logits, target, temperature)
            check_inputs(x, temperature)
            ref_lp.backward(_upstream().double())
            for _, out in results:  # every rank holds the full-vocabulary values
                logprob, entropy, _ = out[dtype, temperature]
                torch.testing.assert_close(logprob.double(), ref_lp, atol=LOGPROB_TOL, rtol=0)
                torch.testing.assert_close(entropy.double(), ref_h, atol=ENTROPY_TOL, rtol=0)
            grad = torch.cat([out[dtype, temperature][2] for _, out in results], dim=-1)
            assert grad.dtype == dtype and grad.shape[-1] == padded
            assert not grad[..., vocab:].any(), "padded ids get no gradient"
            tol = GRAD_TOL if dtype == torch.float32 else BF16_GRAD_TOL
            torch.testing.assert_close(grad[..., :vocab].double(), x.grad, atol=tol, rtol=0)
