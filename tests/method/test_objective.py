"""Tier a: the STAPO / GRPO objective (`method.objective.policy_loss`) with GRPO's settings equals
DeepSeekMath's formula (Shao et al. 2024, Eq. 3) written out in float64, loss and gradient; it
normalises by sequences and refuses to run without a reference."""

import dataclasses
import math

import pytest
import torch

from stapo_megatron.mcore.loss import loss_func
from stapo_megatron.method.config import method_loss_config
from stapo_megatron.method.objective import PolicyLossConfig, PolicyTokens, policy_loss
from tests.helpers.spiky_batch import _spiky_batch


def grpo_reference(logprob, old, ref, adv_B, mask, eps=0.2, beta=0.04):
    """-J_GRPO in float64, written from DeepSeekMath (Shao et al. 2024, Eq. 3), one sequence at a time:
    J = 1/G sum_i 1/|o_i| sum_t [min(r A_i, clip(r, 1-eps, 1+eps) A_i) - beta (pi_ref/pi - log(pi_ref/pi) - 1)]."""
    total, num_sequences = 0.0, 0
    for i in range(logprob.shape[0]):
        terms = []
        for t in range(logprob.shape[1]):
            if not mask[i, t]:
                continue
            lp, lo, lr, a = (float(x[i, t]) for x in (logprob, old, ref, adv_B[:, None].expand_as(logprob)))
            r = math.exp(lp - lo)
            surrogate = min(r * a, min(max(r, 1 - eps), 1 + eps) * a)
            kl = math.exp(lr - lp) - (lr - lp) - 1
            terms.append(surrogate - beta * kl)
        if terms:
            total += sum(terms) / len(terms)
            num_sequences += 1
    return -total / num_sequences


def _grpo_inputs(B=6, S=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, S, generator=gen, dtype=torch.float64) * 4
    logprob = old + torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.4  # ratios well outside 1 +- 0.2
    ref = old + torch.randn(B, S, generator=gen, dtype=torch.float64) * 0.3
    adv_B = torch.randn(B, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([9, 2, 5, 0, 7, 1])  # unequal lengths (and an empty one) tell the means apart
    mask = torch.arange(S)[None, :] < lengths[:, None]
    return logprob, old, ref, adv_B, mask


def test_grpo_loss_equals_the_deepseekmath_formula_in_float64():
    logprob, old, ref, adv_B, mask = _grpo_inputs()
    config = method_loss_config("grpo")
    assert (config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c, config.kl_coef) == (0.2, 0.2, None, 0.04)
    adv = adv_B[:, None].expand_as(logprob)
    # two "micro-batches": Megatron adds their sums and their normalisers, then divides
    grpo = PolicyLossConfig(config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c, config.kl_coef,
                            loss_agg="seq_mean_token_mean")
    parts = [policy_loss(PolicyTokens(logprob[rows], old[rows], adv[rows], mask[rows], torch.zeros_like(mask[rows]),
                                      ref[rows]), grpo)
             for rows in (slice(0, 4), slice(4, 6))]
    loss = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    assert sum(int(p[1]) for p in parts) == 5  # sequences with a response token
    expected = grpo_reference(logprob, old, ref, adv_B, mask)
    # the objective runs in fp32 (inputs are cast): fp32 rounding of exp / sums of ~50 terms
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    token_mean, num_tokens = policy_loss(PolicyTokens(logprob, old, adv, mask, torch.zeros_like(mask), ref),
                                         PolicyLossConfig(0.2, 0.2, None, 0.04))
    assert abs(token_mean.item() / num_tokens.item() - expected) > 1e-2, "the aggregation must matter here"


def test_grpo_gradient_matches_the_float64_formula():
    logprob, old, ref, adv_B, mask = _grpo_inputs(seed=1)
    x = logprob.clone().requires_grad_()
    loss_sum, num = policy_loss(PolicyTokens(x, old, adv_B[:, None].expand_as(x), mask, torch.zeros_like(mask), ref),
                                PolicyLossConfig(0.2, 0.2, None, 0.04, "seq_mean_token_mean"))
    (loss_sum / num).backward()
    x64 = logprob.clone().requires_grad_()
    # the same formula vectorised in float64, for autograd
    r = torch.exp(x64 - old)
    adv = adv_B[:, None].expand_as(x64)
    surrogate = torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    kl = torch.exp(ref - x64) - (ref - x64) - 1
    per_token = torch.where(mask, surrogate - 0.04 * kl, 0.0)
    lengths = mask.sum(-1)
    j = (per_token.sum(-1)[lengths > 0] / lengths[lengths > 0]).mean()
    (-j).backward()
    # fp32 forward/backward against float64: relative rounding ~1e-7 of O(1) gradients
    torch.testing.assert_close(x.grad, x64.grad, atol=1e-6, rtol=1e-5)


def test_grpo_without_a_reference_is_refused():
    logprob, old, ref, adv_B, mask = _grpo_inputs()
    with pytest.raises(ValueError, match="kl_coef > 0 needs ref_logprob"):
        policy_loss(PolicyTokens(logprob, old, adv_B[:, None].expand_as(logprob), mask, torch.zeros_like(mask)),
                    PolicyLossConfig(kl_coef=0.04, loss_agg="seq_mean_token_mean"))
    with pytest.raises(ValueError, match=r"loss_agg must be one of \('token_mean', 'seq_mean_token_mean'\)"):
        policy_loss(PolicyTokens(logprob, old, adv_B[:, None].expand_as(logprob), mask, torch.zeros_like(mask)),
                    PolicyLossConfig(loss_agg="seq"))


def test_grpo_loss_func_normalises_by_sequences():
    logits, logprob, entropy, batch = _spiky_batch()
    config = method_loss_config("grpo")
    ref = batch.old_logprob - 0.1
    loss_sum, normaliser, metrics = loss_func(config, dataclasses.replace(batch, ref_logprob=ref), torch.tensor(float("nan")),
                                              None, None, logits)
    mask = batch.response_mask
    assert normaliser.item() == mask.shape[0]  # every row has response tokens
    assert metrics["stapo_sums"][1].item() == mask.sum().item()  # num_kept still counts tokens
    # on-policy ratio 1: per sequence -A + beta * k3(ref - logp = -0.1), the same for every token
    k3 = math.exp(-0.1) + 0.1 - 1
    adv_B = batch.advantages[:, 0]
    assert loss_sum.item() == pytest.approx((-adv_B + 0.04 * k3).sum().item(), abs=1e-5)
