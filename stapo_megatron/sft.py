"""Supervised warm-start: token-level cross-entropy on (prompt, target response) pairs.

Used by the embedded CPU demo so that a freshly initialised tiny model gets non-zero rewards
before RL (DESIGN.md). Same Megatron machinery as the policy update: the loss function returns
(sum of token NLL, number of target tokens), so Megatron normalises per token over the whole
batch; log-probs come from the same fused vocab-parallel op.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from stapo_megatron.loss import run_microbatches
from stapo_megatron.ops import vocab_parallel_logprob_entropy


def _sft_loss_func(tp_group, vocab_size, batch, logits):
    logprob, _ = vocab_parallel_logprob_entropy(logits, batch["labels"], tp_group=tp_group, vocab_size=vocab_size)
    mask = batch["response_mask"]
    nll_sum = -torch.where(mask, logprob, 0.0).sum()
    num = mask.sum()
    return nll_sum, num.to(torch.int), {"sft": torch.stack([nll_sum.detach(), num.float()])}


def sft_step(model, optimizer, microbatches: List[Dict[str, torch.Tensor]], seq_length: int,
             tp_group=None, dp_group=None, vocab_size: Optional[int] = None) -> Optional[float]:
    """One optimizer step of token-mean NLL over this DP rank's micro-batches.

    Returns the mean NLL over the global batch on the last pipeline stage (None elsewhere).
    """
    model.zero_grad_buffer()
    optimizer.zero_grad()
    out = run_microbatches(model, microbatches, seq_length,
                           lambda batch: partial(_sft_loss_func, tp_group, vocab_size, batch))
    optimizer.step()
    if not out:
        return None
    sums = torch.stack([o["sft"] for o in out]).sum(0)
    if dp_group is not None:
        dist.all_reduce(sums, group=dp_group)
    return float(sums[0] / sums[1]) if sums[1] > 0 else math.nan
