"""Tier a: the op (``ops.logprob_entropy``: its torch path on the CPU) against a full-vocabulary float64
reference, its input checks and options."""

import math

import pytest
import torch

from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

# fp32 op vs float64 reference: sums over ~1e3 terms in fp32 -> a few 1e-6 absolute.
FP32_TOL = 1e-5
# bf16 inputs: log-prob/entropy are still accumulated in fp32 (same tolerance); the returned
# gradient is bf16, so one bf16 ulp of the largest entries (|g| / T <= ~5 here: 2^-8 * 5).
BF16_GRAD_TOL = 2e-2


def reference(logits, target, temperature=1.0):
    x = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    logprob = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return x, logprob, entropy


QWEN_VOCAB = 151936
# Full-vocabulary fp32 accuracy. log p = z_y - log Z with both below 32 here: the roundings of
# z = x / T, of log Z and of the difference are half an ulp of 32 (2^-20) each -> 2^-18.
LOGPROB_TOL = 2**-18
# H = log S - W / S below log V < 16: a few ulps of 16 (2^-20 each), z's rounding included.
ENTROPY_TOL = 2**-18
# Gradient entries g (onehot - p) / T with |g| / T < 4 here and p <= 1 exact to a few ulps (2^-24).
GRAD_TOL = 2**-20


def dominant_inputs(dtype, temperature, seed=0):
    """[2, 4] rows of Qwen-vocabulary logits (randn * 3) where one token holds p > 0.9 in six rows:
    the target itself in rows 0-2 (p = 0.92, 0.99, 0.9999: the gradient's cancellation-prone case)
    and another token in rows 3-5 (p = 0.92, 0.95, 0.99); rows 6-7 are left as drawn."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, QWEN_VOCAB, generator=gen) * 3
    target = torch.randint(0, QWEN_VOCAB, (8,), generator=gen)
    for row, (p, token) in enumerate([(0.92, None), (0.99, None), (0.9999, None), (0.92, 5), (0.95, 77), (0.99, -1)]):
        token = int(target[row]) if token is None else token % QWEN_VOCAB
        others_z = torch.cat([logits[row, :token], logits[row, token + 1 :]]).double() / temperature
        logits[row, token] = temperature * (torch.logsumexp(others_z, 0) + math.log(p / (1 - p)))
    return logits.to(dtype).view(2, 4, QWEN_VOCAB), target.view(2, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_matches_float64_reference(dtype, temperature):
    """The full Qwen vocabulary with dominant tokens: every fp32 sum over 151,936 terms where one
    term is ~1 and the rest are small, the case where a sum accumulated term by term in fp32 loses
    the small terms (the normaliser of torch's CPU softmax is; the op must not inherit it)."""
    logits, target = dominant_inputs(dtype, temperature)
    logits.requires_grad_()
    logprob, entropy = vocab_parallel_logprob_entropy(logits, target, temperature=temperature)
    x, ref_lp, ref_h = reference(logits, target, temperature)
    assert (torch.softmax(x.detach().view(8, -1)[:6] / temperature, -1).amax(-1) > 0.9).all()
    assert logprob.dtype == entropy.dtype == torch.float32
    assert logprob.shape == entropy.shape == target.shape
    torch.testing.assert_close(logprob.double(), ref_lp, atol=LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_h, atol=ENTROPY_TOL, rtol=0)
    upstream = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    logprob.backward(upstream)
    ref_lp.backward(upstream.double())
    assert logits.grad.dtype == dtype
    tol = GRAD_TOL if dtype == torch.float32 else BF16_GRAD_TOL
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=tol, rtol=0)


def test_entropy_is_detached_and_input_untouched():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=gen).requires_grad_()
    before = logits.detach().clone()
    target = torch.randint(0, 64, (4,), generator=gen)
    logprob, entropy = vocab_parallel_logprob_entropy(logits, target)
    assert logprob.requires_grad and not entropy.requires_grad
    logprob.sum().backward()
    assert torch.equal(logits.detach(), before), "the op must never modify its input"


def test_extreme_logits_are_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0, 0.0], [-50.0, -50.0, -50.0, -50.0]], requires_grad=True)
    target = torch.tensor([1, 2])
    logprob, entropy = vocab_parallel_logprob_entropy(logits, target)
    assert torch.isfinite(logprob).all() and torch.isfinite(entropy).all()
    assert logprob[0].item() == pytest.approx(-2e4, rel=1e-6)
    assert entropy[1].item() == pytest.approx(torch.log(torch.tensor(4.0)).item(), abs=1e-6)
    logprob.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_bad_inputs_raise_clear_errors():
    logits = torch.randn(2, 3, 10)
    with pytest.raises(ValueError, match="target shape"):
        vocab_parallel_logprob_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        vocab_parallel_logprob_entropy(logits, torch.full((2, 3), 10))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprob_entropy(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0)
    with pytest.raises(TypeError, match="floating"):
        vocab_parallel_logprob_entropy(logits.long(), torch.zeros(2, 3, dtype=torch.long))


def test_padded_vocabulary_is_excluded():
    """Megatron pads the output layer; padded ids are not tokens and get no probability."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 128, generator=gen).requires_grad_()
    target = torch.randint(0, 100, (6,), generator=gen)
    logprob, entropy = vocab_parallel_logprob_entropy(logits, target, vocab_size=100)
    x, ref_lp, ref_h = reference(logits[:, :100], target)
    torch.testing.assert_close(logprob.double(), ref_lp, atol=FP32_TOL, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_h, atol=FP32_TOL, rtol=0)
    logprob.sum().backward()
    ref_lp.sum().backward()
    assert not logits.grad[:, 100:].any()
    torch.testing.assert_close(logits.grad[:, :100].double(), x.grad, atol=FP32_TOL, rtol=0)
    with pytest.raises(ValueError, match="vocab_size 100"):
        vocab_parallel_logprob_entropy(logits, torch.full((6,), 100), vocab_size=100)


def masked_reference(logits, target, temperature=1.0):
    """Float64 reference that treats -inf logits as masked: 0 log 0 = 0 (and no NaN gradient)."""
    x = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    finite_logp = torch.where(torch.isfinite(logp_all), logp_all, 0.0)
    logprob = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(finite_logp.exp() * finite_logp * torch.isfinite(logp_all)).sum(-1)
    return x, logprob, entropy


@pytest.mark.parametrize("inplace", [False, True])
def test_entropy_gradient_and_inplace_backward(inplace):
    """entropy_grad: d(g logp + h H)/dx = [g (onehot - p) - h p (log p + H)] / T; in place reuses the logits."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(7, 300, generator=gen) * 3).requires_grad_()
    target = torch.randint(0, 300, (7,), generator=gen)
    x, ref_lp, ref_h = reference(logits, target, 0.8)
    source = logits.detach().clone().requires_grad_()
    lp, h = vocab_parallel_logprob_entropy(source, target, temperature=0.8, entropy_grad=True, inplace_backward=inplace)
    assert h.requires_grad
    torch.testing.assert_close(h.double(), ref_h, atol=FP32_TOL, rtol=0)
    g, w = torch.randn(7, generator=gen), torch.randn(7, generator=gen)
    (lp * g + h * w).sum().backward()
    (ref_lp * g.double() + ref_h * w.double()).sum().backward()
    torch.testing.assert_close(source.grad.double(), x.grad, atol=FP32_TOL, rtol=0)
    assert (source.grad.data_ptr() == source.data_ptr()) == inplace
    if not inplace:
        assert torch.equal(source.detach(), logits.detach()), "the op must not modify its input"


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_masked_minus_inf_logits_give_finite_entropy(entropy_grad):
    """Masked vocabulary (-inf logits) is 0 log 0 = 0 (issue 16), including a wholly masked block."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 64, generator=gen) * 2
    logits[0, 10:40] = float("-inf")
    logits[1, ::2] = float("-inf")
    logits[2, :63] = float("-inf")  # one token left: H = 0, log p = 0
    target = torch.tensor([3, 1, 63, 5])
    logits = logits.requires_grad_()
    lp, h = vocab_parallel_logprob_entropy(logits, target, temperature=0.9, entropy_grad=entropy_grad)
    x, ref_lp, ref_h = masked_reference(logits, target, 0.9)
    assert torch.isfinite(h).all() and torch.isfinite(lp).all()
    torch.testing.assert_close(h.double(), ref_h, atol=FP32_TOL, rtol=0)
    torch.testing.assert_close(lp.double(), ref_lp, atol=FP32_TOL, rtol=0)
    assert h[2].item() == pytest.approx(0.0, abs=1e-6) and lp[2].item() == pytest.approx(0.0, abs=1e-6)
    loss = lp.sum() + (h.sum() if entropy_grad else 0)
    loss.backward()
    (ref_lp.sum() + (ref_h.sum() if entropy_grad else 0)).backward()
    assert torch.isfinite(logits.grad).all()
    torch.testing.assert_close(logits.grad.double(), x.grad, atol=FP32_TOL, rtol=0)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_non_finite_temperature_is_refused(temperature):
    with pytest.raises(ValueError, match="temperature must be finite and > 0"):
        vocab_parallel_logprob_entropy(torch.randn(2, 8), torch.zeros(2, dtype=torch.long), temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.bool])
def test_non_integer_target_is_refused(dtype):
    with pytest.raises(TypeError, match=f"integer token ids, got dtype {dtype}"):
        vocab_parallel_logprob_entropy(torch.randn(2, 8), torch.zeros(2, dtype=dtype))


def test_int32_target_and_unknown_impl():
    logits, target = torch.randn(3, 8), torch.tensor([1, 2, 3], dtype=torch.int32)
    lp, _ = vocab_parallel_logprob_entropy(logits, target)
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[torch.arange(3), target.long()])
    with pytest.raises(ValueError, match="impl must be one of"):
        vocab_parallel_logprob_entropy(logits, target, impl="cuda")
