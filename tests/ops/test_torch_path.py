"""Tier a: the torch path's own contract: step 1's partials, the chunking, the gradient buffer."""

import math

import torch

from stapo_megatron.ops import torch_path
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy
from stapo_megatron.ops.torch_path import _local_stats

# fp32 sums over ~300 terms against float64: a few 1e-7 relative, well inside 1e-5 absolute.
FP32_TOL = 1e-5
QWEN_VOCAB = 151936


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
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 500, generator=gen)
    target = torch.randint(0, 500, (37,), generator=gen)
    outs = []
    for chunk_bytes in (1, 7 * 4 * 500, 1 << 30):  # 1 row, 7 rows (ragged tail), everything
        monkeypatch.setattr(torch_path, "_CHUNK_BYTES", chunk_bytes)
        x = logits.clone().requires_grad_()
        lp, h = vocab_parallel_logprob_entropy(x, target)
        lp.sum().backward()
        outs.append((lp.detach(), h, x.grad))
    for lp, h, g in outs[1:]:
        torch.testing.assert_close(lp, outs[0][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(h, outs[0][1], atol=1e-6, rtol=0)
        torch.testing.assert_close(g, outs[0][2], atol=1e-7, rtol=0)


def test_torch_partials_are_relative_to_the_local_max():
    """Step 1 of the torch path (fused softmax, its sums redone from p): m_r = max z, s_r, w_r, q_r
    and the softmax written for backward (p_max_r exp(z - m_r)) equal float64, for peaked, flat,
    partly masked and wholly masked rows, and for bf16 and scaled inputs (which go through the
    fp32 scratch)."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 300, generator=gen) * 3
    logits[1, 7] = 40.0  # peaked: p ~ 1, H ~ 0
    logits[2] = 0.5  # flat: p = 1/300
    logits[3, ::3] = float("-inf")  # partly masked
    logits[4] = float("-inf")  # wholly masked: contributes nothing
    target = torch.tensor([0, 7, 5, 1, 2, 299])
    for dtype, inv_temp in ((torch.float32, 1.0), (torch.float32, 1 / 0.7), (torch.bfloat16, 1.0)):
        x = logits.to(dtype)
        p_out = torch.full(x.shape, float("nan"), dtype=dtype)
        (m, s, w, z_y, q), p_max = _local_stats(x, target, 0, inv_temp, p_out, with_collision=True)
        z = x.double() * inv_temp
        z_max = z.amax(-1)
        e = (z - z_max[:, None]).exp()
        e[4] = 0.0
        ez = torch.where(e > 0, e * (z - z_max[:, None]), 0.0)
        p = torch.softmax(z, dim=-1)
        p[4] = 0.0
        live = torch.arange(6) != 4
        # fp32 softmax and sums over 300 terms: a few 1e-7 relative, well inside 1e-5 absolute
        torch.testing.assert_close(m[live].double(), z_max[live], atol=FP32_TOL, rtol=0)
        assert m[4].item() == float("-inf") and s[4].item() == 0.0 and w[4].item() == 0.0 and q[4].item() == 0.0
        assert p_max[4].item() == 1.0
        torch.testing.assert_close(s.double(), e.sum(-1), atol=0, rtol=1e-6)
        torch.testing.assert_close(w.double(), ez.sum(-1), atol=FP32_TOL, rtol=1e-6)
        torch.testing.assert_close(q.double(), e.square().sum(-1), atol=0, rtol=1e-6)
        torch.testing.assert_close(p_max[live].double(), p[live].amax(-1), atol=0, rtol=1e-6)
        torch.testing.assert_close(z_y.double(), z.gather(-1, target[:, None]).squeeze(-1), atol=FP32_TOL, rtol=0)
        # the buffer backward rescales: p in the logits' dtype (one bf16 ulp of p <= 1: 2^-8)
        torch.testing.assert_close(p_out.double(), p, atol=2 ** -8 if dtype == torch.bfloat16 else 1e-6, rtol=0)


def test_inplace_backward_logprob_only_matches_default():
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(5, 200, generator=gen) * 3).to(torch.bfloat16)
    target = torch.randint(0, 150, (5,), generator=gen)
    grads = []
    for inplace in (False, True):
        x = logits.clone().requires_grad_()
        lp, _ = vocab_parallel_logprob_entropy(x, target, vocab_size=150, inplace_backward=inplace)
        lp.sum().backward()
        grads.append(x.grad.float())
    # same fp32 math, only where the bf16 rounding happens differs: one bf16 ulp of |grad| <= 1
    torch.testing.assert_close(grads[1], grads[0], atol=2 ** -8, rtol=0)
    assert not grads[1][:, 150:].any()


def test_sums_beside_a_dominant_token_at_the_qwen_vocabulary():
    """Rows of 151,936 where one token holds p = 0.95 or 0.9999: torch's fused softmax adds up its
    normaliser in fp32 term by term and loses the small terms here, so step 1 must take s_r, w_r
    and q_r from p itself. Each is a cascade sum of fp32 terms exact to an ulp: a few ulps (2^-24)
    relative to float64, and the gradient buffer times backward's row factor is p to a few ulps."""
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(4, QWEN_VOCAB, generator=gen) * 3
    for row, p in enumerate((0.95, 0.9999)):
        others = torch.cat([logits[row, :row], logits[row, row + 1 :]]).double()
        logits[row, row] = float(torch.logsumexp(others, 0) + math.log(p / (1 - p)))
    target = torch.tensor([0, 1, 2, 3])
    p_out = torch.empty_like(logits)
    (m, s, w, _, q), p_max = _local_stats(logits, target, 0, 1.0, p_out, with_collision=True)
    z = logits.double()
    e = (z - z.amax(-1, keepdim=True)).exp()
    torch.testing.assert_close(m.double(), z.amax(-1), atol=0, rtol=0)
    torch.testing.assert_close(s.double(), e.sum(-1), atol=0, rtol=2**-21)
    torch.testing.assert_close(w.double(), (e * (z - z.amax(-1, keepdim=True))).sum(-1), atol=0, rtol=2**-21)
    torch.testing.assert_close(q.double(), e.square().sum(-1), atol=0, rtol=2**-21)
    # backward's row factor at TP = 1 is 1 / (S p_max): the buffer becomes the exact softmax
    p = p_out.double() / (s.double() * p_max.double())[:, None]
    torch.testing.assert_close(p, torch.softmax(z, -1), atol=2**-22, rtol=0)
