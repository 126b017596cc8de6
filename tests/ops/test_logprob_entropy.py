"""Tier a: the op (``ops.logprob_entropy``: its torch path on the CPU) against a full-vocabulary float64
reference, its input checks and options."""

import pytest
import torch

from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

from stapo_megatron.bridge.transformer_config import padded_vocab_size
from stapo_megatron.ops.combine import normalise, packed_partials
from stapo_megatron.ops.torch_path import _local_stats
from tests.helpers.dominant_logits import (BF16_GRAD_TOL, ENTROPY_TOL, GRAD_TOL, LOGPROB_TOL, QWEN35_VOCAB, TEMPERATURES,
                                           VOCABS, check_inputs, dominant_inputs, padded_logits, reference)

# fp32 op vs float64 reference: sums over ~1e3 terms in fp32 -> a few 1e-6 absolute.
FP32_TOL = 1e-5


@pytest.mark.parametrize("vocab", list(VOCABS.values()), ids=list(VOCABS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_matches_float64_reference(dtype, temperature, vocab):
    """The full Qwen3 and Qwen3.5 vocabularies with dominant tokens: every fp32 sum over 151,936 or
    248,320 terms where one term is ~1 and the rest are small, the case where a sum accumulated
    term by term in fp32 loses the small terms (the normaliser of torch's CPU softmax is; the op
    must not inherit it)."""
    logits, target = dominant_inputs(dtype, temperature, vocab)
    logits.requires_grad_()
    logprob, entropy = vocab_parallel_logprob_entropy(logits, target, temperature=temperature)
    x, ref_lp, ref_h = reference(logits, target, temperature)
    check_inputs(x, temperature)
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


@pytest.mark.parametrize("tp,num_padded", [(2, 0), (4, 0), (8, 512)])
def test_qwen35_vocabulary_split_as_the_bridge_pads_it(tp, num_padded):
    """248,320 = 1,940 x 128 is a multiple of 128 x TP at TP = 1, 2 and 4 (no padding) and is padded
    by 512 ids at TP = 8 (`padded_vocab_size`, the bridge's): each TP rank's partials of its shard
    of the padded output layer's logits (step 1, the padded ids' zero logits excluded by the real
    vocabulary), combined as the op's MAX and packed SUM do (here by hand: ``max`` and ``+`` over
    the shards; tests/integration/test_logprob_entropy_tp.py runs TP = 2 on gloo with the
    backward), equal float64 on the unpadded row. Same tolerances as TP = 1: the shards change
    only the order of the fp32 sums, and log Z stays below the bound the tolerance is derived at."""
    padded = padded_vocab_size(QWEN35_VOCAB, tp)
    assert padded - QWEN35_VOCAB == num_padded
    temperature = 0.7
    logits, target = dominant_inputs(torch.float32, temperature, QWEN35_VOCAB)
    logits, target = logits.view(8, -1), target.view(8)
    vocab_local = padded // tp
    partials = []
    for rank, shard in enumerate(padded_logits(logits, padded).split(vocab_local, dim=-1)):
        num_real = min(vocab_local, QWEN35_VOCAB - rank * vocab_local)
        partials.append(_local_stats(shard[:, :num_real].contiguous(), target, rank * vocab_local, 1 / temperature)[0])
    global_m = torch.stack([p[0] for p in partials]).amax(0)
    packed = sum(packed_partials(m, global_m, s, w, z_y) for m, s, w, z_y, _ in partials)
    _, logprob, entropy, _ = normalise(global_m, packed[0], packed[1], packed[2])
    x, ref_lp, ref_h = reference(logits, target, temperature)
    check_inputs(x, temperature)
    torch.testing.assert_close(logprob.double(), ref_lp, atol=LOGPROB_TOL, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_h, atol=ENTROPY_TOL, rtol=0)


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
    """Masked vocabulary (-inf logits) is 0 log 0 = 0, including a wholly masked block."""
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
