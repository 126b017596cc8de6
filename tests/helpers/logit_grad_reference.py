"""The logit-gradient-norm tests' shared parts: the test logits (one row with p -> 1, one with masked
vocabulary), the float64 references (softmax, and each token's autograd gradient norm), the
objective's inputs, the tolerances with their reasons, and the TP = 2 gloo worker that shards the
vocabulary and counts the op's collectives. Used by ``tests/ops/test_logit_grad.py`` and
``tests/integration/test_logit_grad_tp.py``.
"""

import torch

from stapo_megatron.method.objective import token_objective
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy

# fp32 op vs float64: sum p^2 and p accumulate in fp32 over <= 600 terms (a few ulps of 1).
COLLISION_TOL = 1e-6
# g_t from fp32 log p and sum p^2 vs the float64 autograd norm: the bracket 1 - 2p + sum p^2 is
# known to ~1e-6 absolute, and c_t^2 to fp32 relative precision.
NORM_RTOL, NORM_ATOL = 1e-4, 1e-6


def _logits(seed=0, rows=24, vocab=600, padded=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab + padded, generator=gen) * 3
    logits[0, 0] += 30  # p -> 1: the bracket cancels
    logits[1, 50:400] = float("-inf")  # masked vocabulary
    target = torch.randint(0, vocab, (rows,), generator=gen)
    target[0], target[1] = 0, 3
    return logits, target, gen


def _ref_probs(logits, vocab, temperature):
    return torch.softmax(logits[:, :vocab].double() / temperature, dim=-1)


def _objective_inputs(logprob, gen):
    n = logprob.shape[0]
    old = logprob.detach() + 0.4 * torch.randn(n, generator=gen)  # ratios on both sides of the clip
    adv = torch.randn(n, generator=gen)
    is_weight = torch.rand(n, generator=gen) + 0.5
    ref = logprob.detach() + 0.3 * torch.randn(n, generator=gen)
    return old, adv, is_weight, ref


def _autograd_row_norms(logits, target, old, adv, temperature, vocab, is_weight, ref, kl_coef, clip_c):
    """||d l_t / d x_t||^2 per row in float64: the gradient of the sum of the terms (each term
    depends on its own row only, so row t of that gradient is d l_t / d x_t)."""
    x = logits.double().requires_grad_()
    logp = torch.log_softmax(x[:, :vocab] / temperature, -1).gather(-1, target[:, None]).squeeze(-1)
    term, _ = token_objective(logp, old.double(), adv.double(), 0.2, 0.28, clip_c)
    term = term * is_weight.double()
    if kl_coef:
        log_ratio = ref.double() - logp
        term = term + kl_coef * (torch.expm1(log_ratio) - log_ratio)
    term.sum().backward()
    return x.grad.square().sum(-1)


def _tp_worker(temperature):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logits, target, gen = _logits(seed=2, padded=10)  # vocab 600 of 610: rank 1 holds 295 real entries and 10 of padding
    logits = logits[:, :-10]
    logits = torch.cat([logits, torch.zeros(logits.shape[0], 10)], dim=-1)
    shard = logits[:, rank * 305:(rank + 1) * 305].contiguous()
    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(k.get("op")) or all_reduce(*a, **k)
    x = shard.clone().requires_grad_()
    logprob, _, collision = vocab_parallel_logprob_entropy(x, target, tp_group=dist.group.WORLD,
                                                           temperature=temperature, vocab_size=600,
                                                           with_collision=True)
    logprob.sum().backward()
    dist.all_reduce = all_reduce
    return logits, target, logprob.detach(), collision, len(calls), gen.get_state()
