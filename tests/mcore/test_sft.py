"""The warm-start's label-smoothing term: cross-entropy to the uniform distribution, TP-sharded."""

import torch

from tests.helpers.uniform_ce import REAL_V, _inputs, _reference


def test_uniform_cross_entropy_matches_log_softmax_mean():
    from stapo_megatron.mcore.sft import uniform_cross_entropy

    logits, upstream = _inputs()
    ref, ref_grad = _reference()
    x = logits.clone().requires_grad_()
    out = uniform_cross_entropy(x, vocab_size=REAL_V)
    out.backward(upstream)
    torch.testing.assert_close(out.detach(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad, ref_grad, atol=1e-6, rtol=0)
    assert torch.all(x.grad[:, REAL_V:] == 0), "padded vocabulary rows must get no gradient"
    # label smoothing's optimum: for eps -> 0 the term vanishes from the loss, never negative
    assert torch.all(out > 0)


