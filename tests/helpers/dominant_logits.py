"""The fp32-vs-float64 tests' inputs at a Qwen vocabulary (rows where one token holds p > 0.9), their
float64 reference and the tolerances, with how each is derived. Used by
``tests/ops/test_logprob_entropy.py`` (TP = 1, and the shards' partials combined by hand at the
bridge's TP padding) and ``tests/integration/test_logprob_entropy_tp.py`` (TP = 2 on gloo).
"""

from __future__ import annotations

import math

import torch

QWEN3_VOCAB = 151936
QWEN35_VOCAB = 248320
VOCABS = {"qwen3": QWEN3_VOCAB, "qwen3.5": QWEN35_VOCAB}
TEMPERATURES = (1.0, 0.7, 1.3)

# Full-vocabulary fp32 accuracy. log p = z_y - log Z with both below 32 (`LOG_Z_BOUND`; the tests
# assert it of their inputs): the roundings of z = x / T, of log Z and of the difference are half
# an ulp of 32 (2^-20) each -> 2^-18. The vocabulary enters only through log Z: log V is 11.9 at
# Qwen3's and 12.4 at Qwen3.5's, below the bound at both with the inputs' spread and the p = 0.9999
# token's margin (log(0.9999 / 0.0001) = 9.2) on top.
LOG_Z_BOUND = 32.0
LOGPROB_TOL = 2**-18
# H = log S - W / S below log V < 16 at either vocabulary: a few ulps of 16 (2^-20 each), z's
# rounding included.
ENTROPY_TOL = 2**-18
# Gradient entries g (onehot - p) / T with |g| / T < 4 here and p <= 1 exact to a few ulps (2^-24).
GRAD_TOL = 2**-20
# bf16 inputs: log-prob/entropy are still accumulated in fp32 (same tolerance); the returned
# gradient is bf16, so one bf16 ulp of the largest entries (|g| / T <= ~5 here: 2^-8 * 5).
BF16_GRAD_TOL = 2e-2


def reference(logits, target, temperature=1.0):
    """Float64 log p of ``target`` and H over the whole last dimension, with the leaf."""
    x = logits.detach().double().requires_grad_()
    logp_all = torch.log_softmax(x / temperature, dim=-1)
    logprob = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return x, logprob, entropy


def dominant_inputs(dtype, temperature, vocab, seed=0):
    """[2, 4] rows of ``vocab``-wide logits (randn * 3) where one token holds p > 0.9 in six rows:
    the target itself in rows 0-2 (p = 0.92, 0.99, 0.9999: the gradient's cancellation-prone case)
    and another token in rows 3-5 (p = 0.92, 0.95, 0.99); rows 6-7 are left as drawn."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(8, vocab, generator=gen) * 3
    target = torch.randint(0, vocab, (8,), generator=gen)
    for row, (p, token) in enumerate([(0.92, None), (0.99, None), (0.9999, None), (0.92, 5), (0.95, 77), (0.99, -1)]):
        token = int(target[row]) if token is None else token % vocab
        others_z = torch.cat([logits[row, :token], logits[row, token + 1 :]]).double() / temperature
        logits[row, token] = temperature * (torch.logsumexp(others_z, 0) + math.log(p / (1 - p)))
    return logits.to(dtype).view(2, 4, vocab), target.view(2, 4)


def check_inputs(x, temperature):
    """What the tolerances assume of the float64 leaf ``x`` [..., V]: six rows with p > 0.9 and
    log Z below `LOG_Z_BOUND`."""
    z = x.detach().reshape(-1, x.shape[-1]) / temperature
    assert (torch.softmax(z[:6], -1).amax(-1) > 0.9).all()
    assert (torch.logsumexp(z, -1) < LOG_Z_BOUND).all()


def padded_logits(logits, padded_vocab):
    """The logits of the bridge's padded output layer: `bridge.transforms.pad_vocab` appends zero
    rows to the weight, so every padded id's logit is 0."""
    pad = logits.new_zeros(*logits.shape[:-1], padded_vocab - logits.shape[-1])
    return torch.cat([logits, pad], dim=-1)
