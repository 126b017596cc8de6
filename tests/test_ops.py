"""Tier a: the fused log-prob/entropy op against a full-vocabulary float64 reference."""

import pytest
import torch

from stapo_megatron.ops import vocab_parallel_logprob_entropy

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_matches_float64_reference(dtype, temperature):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 1000, generator=gen) * 4).to(dtype).requires_grad_()
    target = torch.randint(0, 1000, (3, 5), generator=gen)
    # make some targets the argmax so p -> 1 (the cancellation-prone case of the gradient)
    target[0] = logits.detach()[0].float().argmax(-1)
    logprob, entropy = vocab_parallel_logprob_entropy(logits, target, temperature=temperature)
    x, ref_lp, ref_h = reference(logits, target, temperature)
    assert logprob.dtype == entropy.dtype == torch.float32
    assert logprob.shape == entropy.shape == target.shape
    torch.testing.assert_close(logprob.double(), ref_lp, atol=FP32_TOL, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_h, atol=FP32_TOL, rtol=0)
    upstream = torch.randn(3, 5, generator=gen)
    logprob.backward(upstream)
    ref_lp.backward(upstream.double())
    assert logits.grad.dtype == dtype
    tol = FP32_TOL if dtype == torch.float32 else BF16_GRAD_TOL
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


def test_no_grad_path_matches_grad_path():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(9, 300, generator=gen)
    target = torch.randint(0, 300, (9,), generator=gen)
    with torch.no_grad():
        lp0, h0 = vocab_parallel_logprob_entropy(logits, target)
    lp1, h1 = vocab_parallel_logprob_entropy(logits.clone().requires_grad_(), target)
    assert torch.equal(lp0, lp1.detach()) and torch.equal(h0, h1)


def test_chunking_is_invisible(monkeypatch):
    """Rows are processed in cache-sized chunks; results must not depend on the chunk size."""
    import stapo_megatron.ops as ops

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 500, generator=gen)
    target = torch.randint(0, 500, (37,), generator=gen)
    outs = []
    for chunk_bytes in (1, 7 * 4 * 500, 1 << 30):  # 1 row, 7 rows (ragged tail), everything
        monkeypatch.setattr(ops, "_CHUNK_BYTES", chunk_bytes)
        x = logits.clone().requires_grad_()
        lp, h = vocab_parallel_logprob_entropy(x, target)
        lp.sum().backward()
        outs.append((lp.detach(), h, x.grad))
    for lp, h, g in outs[1:]:
        torch.testing.assert_close(lp, outs[0][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(h, outs[0][1], atol=1e-6, rtol=0)
        torch.testing.assert_close(g, outs[0][2], atol=1e-7, rtol=0)


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
