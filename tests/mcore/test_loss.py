"""Tier a: the STAPO loss, its gradient through the fused op, and the Megatron loss_func."""

import dataclasses
import math

import pytest
import torch

from stapo_megatron.method import masks
from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.objective import PolicyLossConfig, PolicyTokens, policy_loss
from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

from tests.helpers.spiky_batch import _spiky_batch

FP32_TOL = 1e-5  # fp32 op vs float64 reference over a 500-entry vocabulary


def reference_objective(logprob, old, adv, keep, lo=0.2, hi=0.28):
    """-J written directly from the paper's formula, in float64."""
    r = torch.exp(logprob - old)
    per_token = torch.minimum(r * adv, torch.clamp(r, 1 - lo, 1 + hi) * adv)
    return -(per_token * keep).sum() / keep.sum()


def test_loss_sum_and_count_by_hand():
    logprob = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5]))
    old = torch.log(torch.tensor([0.25, 0.5, 0.75, 0.5]))  # r = 2, 1, 2/3, 1
    adv = torch.tensor([1.0, 1.0, -1.0, 3.0])
    mask = torch.tensor([True, True, True, False])
    silenced = torch.tensor([False, True, False, False])
    loss_sum, num_kept = policy_loss(PolicyTokens(logprob, old, adv, mask, silenced))
    # token0: min(2*1, 1.28*1) = 1.28; token2: min(-2/3, -0.8) = -0.8 -> loss = -(1.28 - 0.8)
    assert num_kept.item() == 2
    assert loss_sum.item() == pytest.approx(-(1.28 - 0.8))


def test_gradient_matches_float64_reference_through_the_op():
    gen = torch.Generator().manual_seed(0)
    B, S, V = 4, 6, 500
    logits = (torch.randn(B, S, V, generator=gen) * 3).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=gen)
    old = (torch.log_softmax(logits.detach() + 0.3 * torch.randn(B, S, V, generator=gen), -1)
           .gather(-1, labels[..., None]).squeeze(-1))
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2])[:, None].expand(B, S)
    mask = torch.rand(B, S, generator=gen) > 0.2
    silenced = torch.zeros(B, S, dtype=torch.bool)
    silenced[0, 1] = True
    logprob, _ = vocab_parallel_logprob_entropy(logits, labels)
    loss_sum, num_kept = policy_loss(PolicyTokens(logprob, old, adv, mask, silenced))
    (loss_sum / num_kept).backward()

    x = logits.detach().double().requires_grad_()
    ref_lp = torch.log_softmax(x, -1).gather(-1, labels[..., None]).squeeze(-1)
    ref = reference_objective(ref_lp, old.double(), adv.double(), (mask & ~silenced).double())
    ref.backward()
    assert (loss_sum / num_kept).item() == pytest.approx(ref.item(), abs=FP32_TOL)
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=FP32_TOL, rtol=0)
    assert logits.grad[0, 1].abs().max() == 0, "a silenced token must get no gradient"


def test_all_masked_micro_batch_is_zero_not_nan():
    logits = torch.randn(2, 3, 50, requires_grad=True)
    labels = torch.zeros(2, 3, dtype=torch.long)
    logprob, _ = vocab_parallel_logprob_entropy(logits, labels)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    loss_sum, num_kept = policy_loss(PolicyTokens(logprob, logprob.detach() + 100.0, torch.ones(2, 3), mask, mask))
    assert num_kept.item() == 0 and loss_sum.item() == 0.0
    loss_sum.backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_dual_clip_bounds_negative_advantages():
    logprob = torch.log(torch.tensor([0.9]))
    old = torch.log(torch.tensor([0.1]))  # r = 9
    adv = torch.tensor([-1.0])
    keep = torch.tensor([True])
    plain, _ = policy_loss(PolicyTokens(logprob, old, adv, keep, ~keep))
    dual, _ = policy_loss(PolicyTokens(logprob, old, adv, keep, ~keep), PolicyLossConfig(clip_ratio_c=3.0))
    assert plain.item() == pytest.approx(9.0) and dual.item() == pytest.approx(3.0)


def test_kl_term():
    logprob = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    keep = torch.tensor([True])
    base, _ = policy_loss(PolicyTokens(logprob, logprob, torch.zeros(1), keep, ~keep))
    with_kl, _ = policy_loss(PolicyTokens(logprob, logprob, torch.zeros(1), keep, ~keep, ref),
                             PolicyLossConfig(kl_coef=0.1))
    k3 = 0.5 - math.log(0.5) - 1.0  # exp(ref - lp) - (ref - lp) - 1
    assert with_kl.item() - base.item() == pytest.approx(0.1 * k3)
    with pytest.raises(ValueError, match="ref_logprob"):
        policy_loss(PolicyTokens(logprob, logprob, torch.zeros(1), keep, ~keep), PolicyLossConfig(kl_coef=0.1))


def test_config_validation():
    with pytest.raises(ValueError, match="method"):
        LossConfig(method="ppo")
    with pytest.raises(ValueError, match="tau_h_source"):
        LossConfig(tau_h_source="new")
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LossConfig(clip_ratio_c=0.5)


@pytest.mark.parametrize("method", ["stapo", "justrl", "entropy20", "random", "random_uniform"])
def test_loss_func_methods_and_metrics(method):
    logits, logprob, entropy, batch = _spiky_batch()
    config = LossConfig(method=method, tau_p=0.002)
    mask, adv = batch.response_mask, batch.advantages
    threshold = minibatch_threshold(config, logprob, entropy, adv, mask)
    loss_sum, num_kept, metrics = loss_func(config, dataclasses.replace(batch, seed=3), threshold, None, None, logits)
    sums = dict(zip(
        ["loss_sum", "num_kept", "num_response", "num_silenced", "num_candidates"],
        metrics["stapo_sums"][:5].tolist(),
    ))
    s2t_silenced = masks.s2t_mask(logprob, entropy, adv, mask, tau_p=0.002, q=0.75)
    expected_silenced = {
        "stapo": s2t_silenced,
        "justrl": masks.no_mask(mask),
        "entropy20": masks.entropy20_mask(entropy, mask),
        # the random controls silence as many tokens as S2T would, seeded by config.seed and the
        # batch seed: drawn from S2T's candidates (random) or from all response tokens
        "random": masks.random_mask(masks.s2t_candidates(logprob, adv, mask), int(s2t_silenced.sum()), seed=3),
        "random_uniform": masks.random_mask(mask, int(s2t_silenced.sum()), seed=3),
    }[method]
    assert expected_silenced.any() or method == "justrl"
    assert sums["num_silenced"] == expected_silenced.sum().item()
    assert sums["num_response"] == mask.sum().item()
    assert sums["num_candidates"] == masks.s2t_candidates(logprob, adv, mask).sum().item()
    keep = mask & ~expected_silenced
    assert num_kept.item() == keep.sum().item()
    # on-policy (ratio 1, nothing clipped): every kept token contributes -A
    assert loss_sum.item() == pytest.approx(-(adv * keep).sum().item(), abs=1e-5)
    assert metrics["stapo_sums"][6].item() == 0  # clip count


@pytest.mark.parametrize("field, value, message", [
    ("tau_p", 0.0, r"tau_p must be in \(0, 1\]"), ("tau_p", 1.5, r"tau_p must be in \(0, 1\]"),
    ("tau_p", float("nan"), r"tau_p must be in \(0, 1\] \(a probability threshold\), got nan"),
    ("entropy_quantile", 1.0, r"entropy_quantile must be in \(0, 1\), got 1.0"),
    ("entropy_quantile", float("nan"), r"entropy_quantile must be in \(0, 1\), got nan"),
    ("entropy_top_fraction", 0.0, r"entropy_top_fraction must be in \(0, 1\]"),
    ("temperature", 0.0, "temperature must be finite and > 0, got 0.0"),
    ("temperature", float("inf"), "temperature must be finite and > 0, got inf"),
    ("temperature", float("nan"), "temperature must be finite and > 0, got nan"),
    ("kl_coef", -0.1, "kl_coef must be finite and >= 0"), ("kl_coef", float("nan"), "kl_coef must be finite"),
    ("clip_ratio_c", float("nan"), "clip_ratio_c must be > 1, got nan"),
])
def test_config_values_out_of_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        LossConfig(**{field: value})
    assert LossConfig(tau_p=1.0).tau_p == 1.0  # the interval's closed end is allowed


def _loss_inputs(B=3, S=3):
    gen = torch.Generator().manual_seed(0)
    logprob = -torch.rand(B, S, generator=gen)
    return logprob, logprob - 0.1, torch.randn(B, S, generator=gen), torch.ones(B, S, dtype=torch.bool)


def test_per_sequence_advantages_are_refused_not_broadcast_along_tokens():
    # B == S: a [B] advantage would silently broadcast as a per-position (column) advantage.
    logprob, old, _, mask = _loss_inputs()
    adv_B = torch.tensor([1.0, -1.0, 0.5])
    with pytest.raises(ValueError, match=r"advantages has shape \[3\] but logprob has \[3, 3\] \(advantages are "
                                         r"per token: expand a per-sequence \[B\] advantage"):
        policy_loss(PolicyTokens(logprob, old, adv_B, mask, ~mask))
    loss_sum, _ = policy_loss(PolicyTokens(logprob, old, adv_B[:, None].expand_as(logprob), mask, ~mask))
    ratio = torch.exp(logprob - old)  # exp(0.1) lies inside the clip range: the loss is -r A
    assert loss_sum.item() == pytest.approx(-(ratio * adv_B[:, None]).sum().item(), rel=1e-6)


@pytest.mark.parametrize("name, bad, message", [
    ("response_mask", lambda m: m[..., None], r"response_mask has shape \[3, 3, 1\] but logprob has \[3, 3\]"),
    ("response_mask", lambda m: m.long(), "response_mask must be a bool tensor, got torch.int64"),
    ("silenced", lambda m: ~m[:, :2], r"silenced has shape \[3, 2\]"),
    ("old_logprob", lambda m: torch.zeros(3, 3, 1), r"old_logprob has shape \[3, 3, 1\]"),
    ("ref_logprob", lambda m: torch.zeros(3), r"ref_logprob has shape \[3\]"),
])
def test_misshapen_inputs_are_refused(name, bad, message):
    logprob, old, adv, mask = _loss_inputs()
    args = dict(old_logprob=old, advantages=adv, response_mask=mask, silenced=~mask, ref_logprob=old)
    args[name] = bad(mask)
    with pytest.raises(ValueError, match=message):
        policy_loss(PolicyTokens(logprob, **args), PolicyLossConfig(kl_coef=0.1))


def test_fp16_logprobs_do_not_overflow_the_sum():
    # 4096 tokens of loss ~ 20 each: the sum 8.2e4 exceeds float16's 65504.
    logprob = torch.full((4, 1024), -1.0, dtype=torch.float16)
    adv = torch.full((4, 1024), -20.0, dtype=torch.float16)
    mask = torch.ones(4, 1024, dtype=torch.bool)
    loss_sum, num_kept = policy_loss(PolicyTokens(logprob, logprob, adv, mask, ~mask))
    assert loss_sum.dtype == torch.float32 and num_kept.item() == 4096
    assert loss_sum.item() == pytest.approx(20.0 * 4096)


def test_policy_loss_keeps_float64_and_raises_half_precision():
    """Accumulation in at least fp32: float64 inputs stay float64 (they were cast down to fp32),
    bf16 inputs go up to fp32."""
    g = torch.Generator().manual_seed(0)
    logprob = -torch.rand(2, 5, generator=g, dtype=torch.float64)
    old = logprob + 1e-9  # a ratio 1 - 1e-9: fp32 rounds it to exactly 1
    adv = torch.ones(2, 5, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.bool)
    loss, count = policy_loss(PolicyTokens(logprob, old, adv, mask, torch.zeros_like(mask)))
    assert loss.dtype == torch.float64
    expected = -(torch.exp(logprob - old)).sum()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-12)  # float64 keeps the 1e-9
    assert int(count) == 10
    loss_bf16, _ = policy_loss(PolicyTokens(logprob.bfloat16(), old.bfloat16(), adv.bfloat16(), mask,
                                            torch.zeros_like(mask)))
    assert loss_bf16.dtype == torch.float32
