"""The frozen reference policy of GRPO's KL term: built only when ``loss.kl_coef > 0``.

DeepSeekMath's GRPO penalises KL(pi_theta || pi_ref) with the k3 estimator per token
(``stapo_megatron.method.objective``), pi_ref being the policy RL started from. Here pi_ref is a second
Megatron GPTModel built exactly as the policy (same TransformerConfig, so the same TP/PP
sharding), holding a copy of the policy's weights at the start of RL (after the initial
checkpoint is loaded and, on a fresh run, after the warm-start), never trained. Once per step
`add_reference_logprobs` runs it without gradients over the step's micro-batches, with the same
micro-batch runner and the same vocab-parallel log-prob op as the pi_old pass
(``schedule.compute_logprob_entropy`` -> ``stapo_megatron.ops.logprob_entropy``), and stores
``ref_logprob`` in each micro-batch for the loss.

With LoRA (`stapo_megatron.mcore.lora`) the reference is free: the policy's own frozen base with
its adapters turned off for the reference pass (`adapters_disabled`), no second copy of the
weights. It is the model the adapters were added to (a warm-start trains the adapters, so the
reference stays the model before it).

Legend: [B, S] = micro-batch x sequence, aligned with the labels.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List, Optional

import torch

from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.mcore.lora import adapters_disabled, lora_adapters
from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy


def build_reference(policy: torch.nn.Module, build: Callable[[], torch.nn.Module],
                    kl_coef: float) -> Optional[torch.nn.Module]:
    """The reference of a KL term (None without one, ``kl_coef`` 0): ``policy`` itself (the bare
    GPTModel) when it has LoRA adapters, whose base `add_reference_logprobs` runs with them off,
    else `frozen_copy`."""
    if kl_coef <= 0:
        return None
    return policy if lora_adapters(policy) else frozen_copy(policy, build)


def frozen_copy(policy: torch.nn.Module, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """A new model from ``build()`` (the policy's own builder: same config, same shards) holding
    ``policy``'s current weights, without gradients, in eval mode."""
    reference = build()
    reference.load_state_dict(policy.state_dict())
    reference.requires_grad_(False)
    return reference.eval()


@torch.no_grad()
def reset_reference(reference: torch.nn.Module, policy: torch.nn.Module) -> None:
    """Copy ``policy``'s weights into ``reference`` (after a warm-start, RL starts from there);
    nothing when the reference is the policy's LoRA base (`build_reference`)."""
    if reference is policy:
        return
    reference.load_state_dict(policy.state_dict())


def add_reference_logprobs(ctx: PassContext, minis: List[List[MicroBatch]]) -> None:
    """Write the reference's log-probs of the labels into every micro-batch as ``ref_logprob`` [B, S].

    ``ctx.model`` is the reference (a model with LoRA adapters: its base, the adapters off). One
    no-grad forward per micro-batch of every mini-batch (the log-probs exist on the last pipeline
    stage; other stages get zeros, which no loss reads).
    """
    base_only = adapters_disabled(ctx.model) if lora_adapters(ctx.model) else contextlib.nullcontext()
    with base_only:
        for mini in minis:
            stats = compute_logprob_entropy(ctx, mini)
            for i, mb in enumerate(mini):
                mb.ref_logprob = stats[i][0] if ctx.is_last_stage else torch.zeros_like(mb.advantages)
