"""Supervised warm-start: token-level cross-entropy on (prompt, target response) pairs.

Used by the embedded CPU demo so that a freshly initialised tiny model gets non-zero rewards
before RL (docs/design.md). Same Megatron machinery as the policy update: the loss function returns
(sum of token NLL, number of target tokens), so Megatron normalises per token over the whole
batch; log-probs come from the same fused vocab-parallel op.
"""

from __future__ import annotations

import math
from functools import partial
from typing import List, Optional

import torch
import torch.distributed as dist

from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.ops.logprob_entropy import vocab_parallel_logprob_entropy, vocab_shard
from stapo_megatron.utils import collective_device
from stapo_megatron.mcore.schedule import PassContext, run_microbatches


def uniform_cross_entropy(logits: torch.Tensor, tp_group=None, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Per-token cross-entropy to the uniform distribution over the real vocabulary, TP-sharded.

    -(1/V) sum_v log softmax(z)_v = logsumexp(z) - mean_v z_v, differentiable; the padded
    vocabulary (ids >= ``vocab_size``) is excluded. Plain autograd over the local shard: meant
    for the small warm-start, not for 151k-vocabulary training.
    """
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp_group, tp_size, _, vocab_size, num_real = vocab_shard(logits.shape[-1], tp_group, vocab_size)
    z = logits[..., :num_real].float()
    m = z.detach().amax(-1, keepdim=True)
    if tp_size > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    packed = torch.stack([(z - m).exp().sum(-1), z.sum(-1)])
    if tp_size > 1:
        packed = reduce_from_tensor_model_parallel_region(packed, group=tp_group)
    return m.squeeze(-1) + packed[0].log() - packed[1] / vocab_size


def _sft_loss_func(tp_group, vocab_size, label_smoothing, batch: MicroBatch, logits):
    logprob, _ = vocab_parallel_logprob_entropy(logits, batch.labels, tp_group=tp_group, vocab_size=vocab_size)
    mask = batch.response_mask
    nll_sum = -torch.where(mask, logprob, 0.0).sum()
    num = mask.sum()
    loss_sum = nll_sum
    if label_smoothing:
        # (1 - eps) NLL + eps CE(uniform): the target keeps 1 - eps (+ eps/V), every other real
        # token eps/V. The CPU demo uses it so that the warm-started policy keeps a small tail.
        uniform_sum = torch.where(mask, uniform_cross_entropy(logits, tp_group, vocab_size), 0.0).sum()
        loss_sum = (1.0 - label_smoothing) * nll_sum + label_smoothing * uniform_sum
    return loss_sum, num.to(torch.int), {"sft": torch.stack([nll_sum.detach(), num.float()])}


def sft_step(ctx: PassContext, optimizer, microbatches: List[MicroBatch],
             label_smoothing: float = 0.0) -> Optional[float]:
    """One optimizer step of token-mean NLL (label-smoothed if asked) over this DP rank's micro-batches
    (their ``response_mask`` marks the target tokens; the NLL is of the untempered distribution,
    ``ctx.temperature`` is not used).

    Returns the mean (unsmoothed) NLL over the global batch on the last pipeline stage (None elsewhere).
    """
    ctx.model.zero_grad_buffer()
    optimizer.zero_grad()
    out = run_microbatches(ctx.model, microbatches, ctx.seq_length,
                           lambda batch: partial(_sft_loss_func, ctx.tp_group, ctx.vocab_size, label_smoothing, batch))
    optimizer.step()
    if not out:
        return None
    dp_group = ctx.groups.tokens if ctx.groups is not None else None  # DP x CP: ranks with disjoint tokens
    sums = torch.stack([o["sft"] for o in out]).sum(0).to(collective_device(dp_group))
    if dp_group is not None:
        dist.all_reduce(sums, group=dp_group)
    return float(sums[0] / sums[1]) if sums[1] > 0 else math.nan
