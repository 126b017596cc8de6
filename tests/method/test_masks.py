"""Tier a: every S2T condition in isolation, the quantile, and the baseline masks."""

import math

import pytest
import torch

from stapo_megatron.method import masks

TAU_P = 0.002
LOW_P = math.log(0.001)  # p = 0.001 < tau_p
HIGH_P = math.log(0.5)


def make(logprob, entropy, adv, mask):
    t = lambda v, dt=torch.float32: torch.tensor(v, dtype=dt)  # noqa: E731
    return t(logprob), t(entropy), t(adv), t(mask, torch.bool)


def test_each_condition_in_isolation():
    # token 0: all conditions hold; 1: A = 0; 2: A < 0; 3: p >= tau_p; 4: H above tau_H;
    # 5: not a response token; 6,7: extra candidates that set tau_H.
    logprob, entropy, adv, mask = make(
        [LOW_P, LOW_P, LOW_P, HIGH_P, LOW_P, LOW_P, LOW_P, LOW_P],
        [0.1, 0.1, 0.1, 0.1, 5.0, 0.1, 1.0, 2.0],
        [1.0, 0.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        [1, 1, 1, 1, 1, 0, 1, 1],
    )
    # candidates: tokens 0, 4, 6, 7 with H = 0.1, 5.0, 1.0, 2.0 -> q=0.75 quantile (linear)
    expected_tau = torch.quantile(torch.tensor([0.1, 5.0, 1.0, 2.0]), 0.75)
    tau, count = masks.s2t_threshold(entropy, masks.s2t_candidates(logprob, adv, mask, TAU_P), 0.75)
    assert count == 4 and tau.item() == pytest.approx(expected_tau.item())
    silenced = masks.s2t_mask(logprob, entropy, adv, mask, tau_p=TAU_P, q=0.75)
    assert silenced.tolist() == [True, False, False, False, False, False, True, True]


def test_inequalities_are_strict():
    # p exactly tau_p is not a candidate; H exactly tau_H is not silenced.
    logprob, entropy, adv, mask = make([math.log(0.25), math.log(0.1)], [1.0, 1.0], [1.0, 1.0], [1, 1])
    assert not masks.s2t_candidates(logprob, adv, mask, tau_p=0.25)[0]
    assert masks.s2t_candidates(logprob, adv, mask, tau_p=0.25)[1]
    silenced = masks.s2t_mask(logprob, entropy, adv, mask, tau_p=0.5, q=0.5)  # tau_H = 1.0
    assert not silenced.any()


def test_no_candidates_silences_nothing():
    logprob, entropy, adv, mask = make([HIGH_P, LOW_P], [0.1, 0.1], [1.0, -1.0], [1, 1])
    tau, count = masks.s2t_threshold(entropy, masks.s2t_candidates(logprob, adv, mask, TAU_P))
    assert count == 0 and math.isnan(tau.item())
    assert not masks.s2t_mask(logprob, entropy, adv, mask).any()


def test_precomputed_threshold_is_used():
    logprob, entropy, adv, mask = make([LOW_P, LOW_P], [0.1, 0.3], [1.0, 1.0], [1, 1])
    silenced = masks.s2t_mask(logprob, entropy, adv, mask, tau_h=torch.tensor(0.2))
    assert silenced.tolist() == [True, False]


@pytest.mark.parametrize("n", [1, 2, 7, 100])
@pytest.mark.parametrize("q", [0.0, 0.25, 0.75, 1.0])
def test_quantile_matches_torch(n, q):
    values = torch.randn(n, generator=torch.Generator().manual_seed(n))
    torch.testing.assert_close(masks.quantile_linear(values, q), torch.quantile(values, q))


def test_entropy20_keeps_top_fraction():
    entropy = torch.arange(10, dtype=torch.float32)
    mask = torch.ones(10, dtype=torch.bool)
    mask[9] = False  # the highest entropy is not a response token: it does not count
    silenced = masks.entropy20_mask(entropy, mask, rho=0.2)
    threshold = torch.quantile(entropy[:9], 0.8)  # 6.4
    assert masks.entropy20_threshold(entropy, mask).item() == pytest.approx(threshold.item())
    assert silenced.tolist() == [True] * 7 + [False, False, False]


def test_random_mask_count_support_and_seed():
    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]], dtype=torch.bool)
    a = masks.random_mask(mask, 3, seed=7)
    assert a.sum() == 3 and not (a & ~mask).any()
    assert torch.equal(a, masks.random_mask(mask, 3, seed=7))
    draws = {tuple(masks.random_mask(mask, 1, seed=s).flatten().tolist()) for s in range(60)}
    assert len(draws) == 6, "every response token must be reachable"
    assert not masks.random_mask(mask, 0, seed=0).any()
    with pytest.raises(ValueError, match="num_silenced"):
        masks.random_mask(mask, 7, seed=0)


def test_no_mask():
    assert not masks.no_mask(torch.ones(3, 4, dtype=torch.bool)).any()


def test_mask_refuses_tensors_of_another_shape():
    """An entropy tensor of another shape used to raise a bare IndexError; a per-sequence [B]
    advantage with [B, S] tensors and B == S used to broadcast along the token axis."""
    logprob = torch.full((3, 3), math.log(1e-3))
    entropy, mask = torch.ones(3, 3), torch.ones(3, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"entropy has shape \[3, 4\] but logprob has \[3, 3\]"):
        masks.s2t_mask(logprob, torch.ones(3, 4), torch.ones(3, 3), mask)
    with pytest.raises(ValueError, match=r"advantages has shape \[3\].*adv\[:, None\]"):
        masks.s2t_mask(logprob, entropy, torch.tensor([1.0, -1.0, 1.0]), mask)
    with pytest.raises(ValueError, match="response_mask has shape"):
        masks.s2t_mask(logprob, entropy, torch.ones(3, 3), mask[:, :2])
