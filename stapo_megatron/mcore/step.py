"""One STAPO policy update with Megatron-Core: DDP, optimizer, forward_backward, metrics.

This is steps 4-5 of docs/design.md's training step (old log-probs, then per mini-batch the loss and
an optimizer step), independent of where rollouts come from. The trainer, the demo and the
multi-process tests all go through it.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Dict, List

import torch

from stapo_megatron.method.config import LossConfig
from stapo_megatron.method.registry import get_method
from stapo_megatron.method.rollout_correction import selection_logprob
from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.mcore.config import OptimConfig
from stapo_megatron.mcore.loss import loss_func, minibatch_threshold
from stapo_megatron.mcore.loss_metrics import reduce_metrics
from stapo_megatron.mcore.moe import MoEStepMonitor
from stapo_megatron.mcore.schedule import PassContext, compute_logprob_entropy, run_microbatches


def wrap_ddp(model: torch.nn.Module, use_distributed_optimizer: bool = False, overlap_grad_reduce: bool = False):
    """Wrap a Megatron GPTModel in Megatron DDP (parameters broadcast from DP rank 0) and
    install the schedule's gradient hooks on its TransformerConfig.

    With ``calculate_per_token_loss`` Megatron's ``finalize_model_grads`` divides the gradients
    by the mini-batch's total token count (here: kept tokens), all-reduced over DP and
    broadcast from the last PP stage: the STAPO renormalisation.

    ``overlap_grad_reduce``: reduce each gradient bucket over DP as soon as the last
    micro-batch's backward has filled it, overlapping communication with the rest of the
    backward. The schedule then needs ``config.no_sync_func`` (DDP's ``no_sync``, holding the
    reduction back during the earlier micro-batches, whose gradients only accumulate) and
    ``config.grad_sync_func`` (``start_grad_sync``, with which the pipeline schedules launch a
    model chunk's reduction early), set as Megatron-LM's ``training.py`` sets them.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads

    config = model.config
    if not config.calculate_per_token_loss:
        raise ValueError("the STAPO loss needs TransformerConfig(calculate_per_token_loss=True)")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    config.finalize_model_grads_func = finalize_model_grads
    ddp_model = DistributedDataParallel(config, ddp_config, model)
    # Without overlap the schedule's defaults (no context, no early sync) are right: the one
    # reduction runs in finalize_model_grads after the last micro-batch.
    config.no_sync_func = ddp_model.no_sync if overlap_grad_reduce else None
    config.grad_sync_func = ddp_model.start_grad_sync if overlap_grad_reduce else None
    # Megatron DDP does not synchronise the replicas' initial weights. init_parallel seeds
    # every DP rank alike, so they already agree; the broadcast from DP rank 0 keeps that true
    # for models built or loaded any other way (one broadcast per parameter, once per run).
    ddp_model.broadcast_params()
    return ddp_model


def build_optimizer(ddp_model, optim: OptimConfig):
    """The Megatron optimizer (AdamW or SGD) over a DDP-wrapped model."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = ddp_model.config
    opt_config = OptimizerConfig(
        optimizer=optim.optimizer,
        sgd_momentum=0.0,
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        clip_grad=optim.clip_grad,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        # megatron-core (0.16.1 - 0.19.2, optimizer/__init__.py) gives SGD no init_state_fn, which
        # loading a checkpoint calls; SGD without momentum has no state to initialise
        if opt.init_state_fn is None:
            opt.init_state_fn = lambda inner, config=None: None
    return optimizer


def wrap_model_and_optimizer(model: torch.nn.Module, optim: OptimConfig):
    """``wrap_ddp`` then ``build_optimizer``: (ddp_model, optimizer)."""
    ddp_model = wrap_ddp(model, optim.use_distributed_optimizer, optim.overlap_grad_reduce)
    return ddp_model, build_optimizer(ddp_model, optim)


def _clip_grads(optimizer, max_norm: float, grad_norm: float) -> None:
    """Scale the gradients so that their total norm (``grad_norm``, of every parameter) is at most
    ``max_norm``. MoE models get a ChainedOptimizer (dense and expert parameters apart), which has
    no ``clip_grad_norm`` of its own; each of its optimizers is clipped by the joint norm, as
    megatron-core's ``ChainedOptimizer.step`` does (a single optimizer is its own chain)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = opt.get_parameters()
        if params:
            clip_grad_by_total_norm_fp32(params, max_norm, grad_norm)


@dataclasses.dataclass
class UpdateResult:
    """What one `policy_update` reports."""

    metrics: Dict[str, float]
    """The same on every rank: loss, silenced count/fraction, tau_h, ..., grad_norm, skipped
    (1.0 when the optimizer skipped the step on a NaN/Inf gradient); for a MoE model also
    per-layer expert load and aux loss (``moe/...``, `stapo_megatron.mcore.moe`)."""
    silenced_tokens: List[List[float]]
    """This rank's silenced tokens as (label id, log p, H, A, log p_rollout, mismatch-flagged)
    rows (last pipeline stage; empty elsewhere): the silenced-token inspector's input."""


def policy_update(
    ctx: PassContext,
    optimizer,
    microbatches: List[MicroBatch],
    loss_config: LossConfig,
) -> UpdateResult:
    """One mini-batch: threshold, forward/backward over its micro-batches, optimizer step.

    Args:
        ctx: the DDP-wrapped model (``wrap_model_and_optimizer``), sequence length, process
            groups and real vocabulary size; its temperature must be the loss's.
        microbatches: this DP rank's micro-batches of the mini-batch, with ``old_logprob``
            (``schedule.old_policy_pass``). With ``tau_h_source == "old"`` the threshold reads
            their ``old_logprob`` / ``old_entropy``; with "exact" (or without ``old_entropy``)
            a no-grad pre-pass with the current weights computes them.
    Returns:
        the `UpdateResult`: the mini-batch's metrics and this rank's silenced tokens.
    """
    if ctx.temperature != loss_config.temperature:
        raise ValueError(f"PassContext.temperature {ctx.temperature} != loss.temperature {loss_config.temperature}")
    groups = ctx.groups
    if loss_config.tau_h_source == "exact" or any(mb.old_entropy is None for mb in microbatches):
        stats = compute_logprob_entropy(ctx, microbatches)
    else:
        stats = [(mb.old_logprob, mb.old_entropy) for mb in microbatches]
    threshold = torch.tensor(float("nan"))
    if groups.is_last_stage and get_method(loss_config.method).needs_entropy:
        # micro-batches may still be on the CPU (library users); the statistics are on the model's device
        logprob = torch.cat([lp.reshape(-1) for lp, _ in stats])
        cat = lambda key: torch.cat([getattr(mb, key).reshape(-1) for mb in microbatches]).to(logprob.device)  # noqa: E731
        if loss_config.s2t_probability == "rollout":  # S2T candidates by the sampler's p (loss.py)
            missing = any(mb.rollout_logprob is None for mb in microbatches)
            logprob = selection_logprob("rollout", logprob, None if missing else cat("rollout_logprob"))
        threshold = minibatch_threshold(
            loss_config,
            logprob,
            torch.cat([h.reshape(-1) for _, h in stats]),
            cat("advantages"),
            cat("response_mask"),
            groups.tokens,  # every candidate of the mini-batch: DP x CP ranks hold disjoint tokens
        )
    ctx.model.zero_grad_buffer()
    optimizer.zero_grad()
    # MoE: expert-load metrics, and the aux loss weighted c x aux whatever the mask keeps (mcore/moe.py)
    moe = MoEStepMonitor(ctx.model, cp_group=ctx.cp_group)
    with moe:
        losses_reduced = run_microbatches(
            ctx.model, microbatches, ctx.seq_length,
            lambda batch: moe.scaled_loss(partial(loss_func, loss_config, batch, threshold, ctx.tp_group,
                                                  ctx.vocab_size, cp_group=ctx.cp_group)),
            replay_routes=ctx.replay_routes,
        )
    metrics = reduce_metrics(losses_reduced, threshold, groups.tokens, groups.pp, groups.pp_last_rank)
    metrics.update(moe.metrics(groups.tokens))  # loads over DP x CP, each micro-batch's aux over CP first
    # The optimizer step by hand (what MegatronOptimizer.step does) so that a NaN/Inf loss or
    # gradient skips the update on every rank alike instead of corrupting the weights.
    found_inf = optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    finite = not found_inf and math.isfinite(grad_norm) and math.isfinite(metrics["loss"])
    if finite:
        if optimizer.config.clip_grad > 0:
            _clip_grads(optimizer, optimizer.config.clip_grad, grad_norm)
        optimizer.step_with_ready_grads()
    metrics["grad_norm"] = grad_norm
    metrics["skipped"] = 0.0 if finite else 1.0
    return UpdateResult(metrics, [row for item in losses_reduced for row in item["silenced_tokens"].tolist()])
