"""The per-token logit-gradient norm (ops/logit_grad.py) and the op's collision sum against autograd.

Tier a: the fused op's sum_v p_v^2 against a float64 softmax; each token's norm from the op against
the norm of the autograd gradient of that token's loss term w.r.t. its logits; a micro-batch's
shares (loss_func) against autograd over the whole micro-batch; the histogram median. Tier b, the
same at TP = 2 over gloo, where the collision sum must ride the op's 2 collectives, is
``tests/integration/test_logit_grad_tp.py``; the inputs, references and tolerances both use are in
``tests/helpers/logit_grad_reference.py``.
"""

import dataclasses
import math

import pytest
import torch

from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.objective import PolicyTokens, policy_loss, token_objective
from stapo_megatron.ops import logit_grad
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy
from tests.helpers.logit_grad_reference import (COLLISION_TOL, NORM_ATOL, NORM_RTOL, _autograd_row_norms, _logits,
                                                _objective_inputs, _ref_probs)
from tests.helpers.spiky_batch import _spiky_batch


@pytest.mark.parametrize("temperature,padded", [(1.0, 0), (0.7, 40)])
def test_collision_matches_float64_and_changes_nothing_else(temperature, padded):
    logits, target, gen = _logits(padded=padded)
    upstream = torch.randn(2, logits.shape[0], generator=gen)
    kw = dict(temperature=temperature, vocab_size=600, entropy_grad=True)
    outs = []
    for with_collision in (False, True):
        x = logits.clone().requires_grad_()
        out = vocab_parallel_logprob_entropy(x, target, with_collision=with_collision, **kw)
        ((out[0] * upstream[0]).sum() + (out[1] * upstream[1]).sum()).backward()
        outs.append((out, x.grad))
    (lp, h), grad = outs[0]
    (lp_c, h_c, collision), grad_c = outs[1]
    assert torch.equal(lp, lp_c) and torch.equal(h, h_c) and torch.equal(grad, grad_c), "values and grads unchanged"
    assert not collision.requires_grad
    expected = _ref_probs(logits, 600, temperature).square().sum(-1)
    torch.testing.assert_close(collision.double(), expected, atol=COLLISION_TOL, rtol=0)
    assert collision[0] > 0.999 and collision.min() > 0


@pytest.mark.parametrize("temperature,kl_coef,clip_c", [(1.0, 0.0, None), (0.6, 0.05, 3.0)])
def test_per_token_norm_equals_autograd(temperature, kl_coef, clip_c):
    logits, target, gen = _logits(seed=1, padded=8)
    logprob, _, collision = vocab_parallel_logprob_entropy(logits, target, temperature=temperature,
                                                           vocab_size=600, with_collision=True)
    old, adv, is_weight, ref = _objective_inputs(logprob, gen)
    coef = logit_grad.logprob_coefficient(logprob, old, adv, 0.2, 0.28, clip_c, is_weight, ref, kl_coef)
    grad_sq = logit_grad.logit_grad_sq_norm(coef, logprob, collision, temperature)
    expected = _autograd_row_norms(logits, target, old, adv, temperature, 600, is_weight, ref, kl_coef, clip_c)
    torch.testing.assert_close(grad_sq.double(), expected, rtol=NORM_RTOL, atol=NORM_ATOL)
    _, is_clipped = token_objective(logprob, old, adv)
    assert is_clipped.any() and (grad_sq[is_clipped] == 0).all() == (kl_coef == 0), "the clip zeroes it"


def test_loss_func_shares_equal_autograd_over_the_micro_batch():
    logits, logprob, entropy, batch = _spiky_batch(seed=4)
    gen = torch.Generator().manual_seed(5)
    old = logprob.detach() + 0.3 * torch.randn(logprob.shape, generator=gen)
    batch = dataclasses.replace(batch, old_logprob=old, seed=0)
    config = LossConfig(method="stapo", tau_p=0.002, temperature=0.9)
    logprob, entropy = vocab_parallel_logprob_entropy(logits, batch.labels, temperature=0.9)
    threshold = minibatch_threshold(config, logprob, entropy, batch.advantages, batch.response_mask)
    x = logits.clone().requires_grad_()
    _, _, metrics = loss_func(config, batch, threshold, None, None, x)
    parts = logit_grad.unpack(metrics["grad_norm_sums"].tolist())
    silenced = torch.zeros_like(batch.response_mask)
    rows = metrics["silenced_tokens"]
    assert len(rows) > 0, "the batch must silence tokens"
    # the loss before silencing, and its gradient w.r.t. every logit, in float64
    xd = logits.double().requires_grad_()
    logp = torch.log_softmax(xd / 0.9, -1).gather(-1, batch.labels[..., None]).squeeze(-1)
    loss_sum, _ = policy_loss(PolicyTokens(logp, old.double(), batch.advantages.double(), batch.response_mask, silenced))
    loss_sum.backward()
    row_sq = xd.grad.square().sum(-1)
    from stapo_megatron.method import masks as s2t

    mask = s2t.s2t_mask(logprob, entropy, batch.advantages, batch.response_mask, tau_h=threshold)
    candidates = s2t.s2t_candidates(logprob, batch.advantages, batch.response_mask)
    total = row_sq.sum().item()
    assert parts["grad_sq_trained"] == pytest.approx(total, rel=NORM_RTOL)
    assert parts["grad_sq_silenced"] / parts["grad_sq_trained"] == pytest.approx(row_sq[mask].sum().item() / total,
                                                                                 rel=NORM_RTOL)
    assert parts["grad_sq_candidates"] / parts["grad_sq_trained"] == pytest.approx(
        row_sq[candidates].sum().item() / total, rel=NORM_RTOL)
    torch.testing.assert_close(rows[:, 6].double(), row_sq[mask].sqrt(), rtol=NORM_RTOL, atol=NORM_ATOL)
    assert sum(parts["hist_silenced"]) == mask.sum().item()
    assert sum(parts["hist_kept"]) == (batch.response_mask & ~mask).sum().item()
    assert sum(parts["grid_count"]) == batch.response_mask.sum().item()
    assert sum(parts["grid_grad_sq_sum"]) == pytest.approx(total, rel=NORM_RTOL)


def test_histogram_median_within_one_bin_and_step_metrics():
    gen = torch.Generator().manual_seed(6)
    norms = torch.exp(torch.randn(501, generator=gen) * 3 - 4)
    norms[:40] = 0.0  # clip-zeroed
    trained = torch.ones(501, dtype=torch.bool)
    silenced = torch.zeros(501, dtype=torch.bool)
    silenced[-5:] = True
    sums = logit_grad.grad_norm_sums(norms.square(), torch.full((501,), -1.0), torch.ones(501), trained,
                                     silenced, silenced)
    parts = logit_grad.unpack(sums.tolist())
    kept = norms[:-5]
    exact = kept.median().item()  # 496 values: torch's lower median
    bin_factor = 10.0 ** ((logit_grad.HIST_LOG10_MAX - logit_grad.HIST_LOG10_MIN) / logit_grad.HIST_BINS)
    assert exact / bin_factor <= logit_grad.hist_median(parts["hist_kept"]) <= exact * bin_factor
    assert logit_grad.hist_median([5.0] + [0.0] * (logit_grad.HIST_BINS - 1)) == 0.0
    assert math.isnan(logit_grad.hist_median([0.0] * logit_grad.HIST_BINS))
    # two updates: the step's shares are ratios of the summed squared norms
    row = logit_grad.step_metrics([{"grad_norm_sums": sums.tolist()}, {"grad_norm_sums": sums.tolist()}])
    assert row["grad_share_silenced"] == pytest.approx(norms[-5:].square().sum().item() / norms.square().sum().item(),
                                                       rel=1e-5)
    assert row["grad_share_candidates"] == row["grad_share_silenced"]
    assert row["grad_norm_median_ratio"] == pytest.approx(row["grad_norm_median_silenced"]
                                                          / row["grad_norm_median_kept"])
    assert sum(row["grad_norm_grid_count"]) == 2 * 501
    assert logit_grad.step_metrics([]) == {}
