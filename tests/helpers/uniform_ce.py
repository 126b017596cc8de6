"""The label-smoothing term's test inputs (a vocabulary whose last TP shard carries padded rows,
as Megatron's output layer does), its full-vocabulary autograd reference, and a gloo worker that
computes it TP-sharded."""

import torch
import torch.nn.functional as F

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
