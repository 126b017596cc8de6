"""The warm-start's label-smoothing term: cross-entropy to the uniform distribution, TP-sharded."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.dist_utils import run_distributed

V, REAL_V, N = 64, 59, 10  # the last TP shard carries padded rows, as Megatron's output layer does


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(N, V, generator=gen) * 4, torch.randn(N, generator=gen)


def _reference():
    logits, upstream = _inputs()
    x = logits.clone().requires_grad_()
    ref = -F.log_softmax(x[:, :REAL_V], dim=-1).mean(-1)
    ref.backward(upstream)
    return ref.detach(), x.grad


def test_uniform_cross_entropy_matches_log_softmax_mean():
    from stapo_megatron.mcore.sft import uniform_cross_entropy

    logits, upstream = _inputs()
    ref, ref_grad = _reference()
    x = logits.clone().requires_grad_()
    out = uniform_cross_entropy(x, vocab_size=REAL_V)
    out.backward(upstream)
    torch.testing.assert_close(out.detach(), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(x.grad, ref_grad, atol=1e-6, rtol=0)
    assert torch.all(x.grad[:, REAL_V:] == 0), "padded vocabulary rows must get no gradient"
    # label smoothing's optimum: for eps -> 0 the term vanishes from the loss, never negative
    assert torch.all(out > 0)


def _tp_worker():
    import torch.distributed as dist

    from stapo_megatron.mcore.sft import uniform_cross_entropy

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, upstream = _inputs()
    shard = logits[:, rank * V // world : (rank + 1) * V // world].clone().requires_grad_()
    out = uniform_cross_entropy(shard, tp_group=dist.group.WORLD, vocab_size=REAL_V)
    out.backward(upstream)
    return out.detach(), shard.grad


