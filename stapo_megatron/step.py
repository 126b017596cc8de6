"""One STAPO policy update with Megatron-Core: DDP, optimizer, forward_backward, metrics.

This is steps 4-5 of DESIGN.md's training step (old log-probs, then per mini-batch the loss and
an optimizer step), independent of where rollouts come from. The trainer, the demo and the
multi-process tests all go through it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from stapo_megatron.loss import LossConfig, compute_logprob_entropy, make_forward_step
from stapo_megatron.loss import minibatch_threshold, reduce_metrics
from stapo_megatron.parallel import Groups


@dataclasses.dataclass
class OptimConfig:
    """AdamW settings (defaults: the JustRL recipe the paper uses)."""

    lr: float = 1e-6
    """Peak learning rate (constant after warm-up in the paper)."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    clip_grad: float = 1.0
    """Global gradient-norm clip."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (Megatron DistributedOptimizer)."""
    optimizer: str = "adam"
    """"adam" (AdamW) or "sgd" (plain SGD, momentum 0: used by the parity tests, where Adam
    would amplify fp32 reduction-order noise on near-zero gradients)."""


def wrap_model_and_optimizer(model: torch.nn.Module, optim: OptimConfig):
    """Wrap a Megatron GPTModel in Megatron DDP and build its Megatron optimizer.

    Also installs Megatron's ``finalize_model_grads`` as the schedule's finalize function: with
    ``calculate_per_token_loss`` it divides the gradients by the mini-batch's total token count
    (here: kept tokens), all-reduced over DP and broadcast from the last PP stage.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    if not config.calculate_per_token_loss:
        raise ValueError("the STAPO loss needs TransformerConfig(calculate_per_token_loss=True)")
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    ddp_model = DistributedDataParallel(config, ddp_config, model)
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
    config.finalize_model_grads_func = finalize_model_grads
    return ddp_model, optimizer


def policy_update(
    model,
    optimizer,
    microbatches: List[Dict[str, torch.Tensor]],
    loss_config: LossConfig,
    groups: Groups,
    seq_length: int,
    old_stats: Optional[List] = None,
) -> Dict[str, float]:
    """One mini-batch: threshold, forward/backward over its micro-batches, optimizer step.

    Args:
        model: the DDP-wrapped model (``wrap_model_and_optimizer``).
        microbatches: this DP rank's micro-batches of the mini-batch (see ``make_forward_step``
            for the fields).
        old_stats: per micro-batch (logprob, entropy) of the pi_old pass (last stage), used for
            the threshold when ``tau_h_source == "old"``; recomputed when None or "exact".
    Returns:
        metrics (same on every rank): loss, silenced count/fraction, tau_h, ..., grad_norm,
        skipped (1.0 when the optimizer skipped the step on a NaN/Inf gradient).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if old_stats is None or loss_config.tau_h_source == "exact":
        old_stats = compute_logprob_entropy(
            model, microbatches, seq_length, loss_config.temperature, groups.tp
        )
    threshold = torch.tensor(float("nan"))
    if groups.is_last_stage and loss_config.method != "grpo":
        cat = lambda key: torch.cat([mb[key].reshape(-1) for mb in microbatches])  # noqa: E731
        threshold = minibatch_threshold(
            loss_config,
            torch.cat([lp.reshape(-1) for lp, _ in old_stats]),
            torch.cat([h.reshape(-1) for _, h in old_stats]),
            cat("advantages"),
            cat("response_mask"),
            groups.dp,
        )
    model.zero_grad_buffer()
    optimizer.zero_grad()
    losses_reduced = get_forward_backward_func()(
        forward_step_func=make_forward_step(loss_config, threshold, groups.tp),
        data_iterator=iter(microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=microbatches[0]["tokens"].shape[0],
        forward_only=False,
    )
    update_successful, grad_norm, _ = optimizer.step()
    metrics = reduce_metrics(losses_reduced, threshold, groups.dp, groups.pp, groups.pp_last_rank)
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["skipped"] = 0.0 if update_successful else 1.0
    metrics["tau_h_source"] = loss_config.tau_h_source  # logged: which mini-batch semantics ran
    return metrics
