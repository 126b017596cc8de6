"""The STAPO loss's metrics: per-micro-batch sums (`METRIC_SUMS`) and their reduction to step metrics.

The loss function (``stapo_megatron.mcore.loss.loss_func``) reports one vector of sums per
micro-batch (`metric_sums`); `reduce_metrics` adds them over micro-batches and DP ranks and
broadcasts them from the last pipeline stage, so every rank logs the same numbers.

Legend: [B, S] = micro-batch x sequence, aligned with the labels.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Optional

import torch
import torch.distributed as dist

from stapo_megatron.ops import logit_grad
from stapo_megatron.utils import collective_device

# Per-micro-batch sums reported by the loss function, reduced over micro-batches and DP ranks.
METRIC_SUMS = (
    "loss_sum", "num_kept", "num_response", "num_silenced", "num_candidates",
    "entropy_sum", "num_clipped", "kl_sum", "abs_logprob_diff_sum", "loss_normaliser",
    # rollout/training mismatch (``method.rollout_correction``): flagged tokens, their overlap
    # with S2T's silenced tokens and candidates, the correction's rejected tokens and IS weights
    "num_flagged", "num_silenced_flagged", "num_candidates_flagged", "num_rejected", "is_weight_sum",
    "num_truncated",
)


@torch.no_grad()
def metric_sums(
    loss_sum: torch.Tensor,
    num_kept: torch.Tensor,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    silenced: torch.Tensor,
    candidates: torch.Tensor,
    is_clipped: torch.Tensor,
    loss_normaliser: Optional[torch.Tensor] = None,
    flagged: Optional[torch.Tensor] = None,
    rejected: Optional[torch.Tensor] = None,
    is_weight: Optional[torch.Tensor] = None,
    tis_cap: float = math.inf,
) -> torch.Tensor:
    """One micro-batch's sums, in the order of `METRIC_SUMS` (fp32 vector).

    ``loss_normaliser``: what the loss sum is divided by over the mini-batch (the loss
    function's second output: kept tokens, or sequences for GRPO); default ``num_kept``.
    ``flagged`` (mismatch-flagged response tokens), ``rejected`` (the rollout correction's
    masked tokens), ``is_weight`` (its truncated IS weights, capped at ``tis_cap``): [B, S],
    None = none flagged, none rejected, weight 1."""
    if loss_normaliser is None:
        loss_normaliser = num_kept
    none = torch.zeros_like(response_mask)
    flagged = none if flagged is None else flagged
    rejected = none if rejected is None else rejected
    keep = response_mask & ~silenced & ~rejected
    weight_sum = keep.sum().float() if is_weight is None else torch.where(keep, is_weight.float(), 0.0).sum()
    num_truncated = none.sum().float() if is_weight is None else (keep & (is_weight >= tis_cap)).sum().float()
    log_ratio = logprob - old_logprob
    return torch.stack([
        loss_sum.detach(),
        num_kept.float(),
        response_mask.sum().float(),
        silenced.sum().float(),
        candidates.sum().float(),
        torch.where(response_mask, entropy, 0.0).sum(),
        (is_clipped & keep).sum().float(),
        # k3 estimator of KL(pi_old || pi_theta) on response tokens
        torch.where(response_mask, torch.expm1(log_ratio) - log_ratio, 0.0).sum(),  # expm1: exact for small ratios
        torch.where(response_mask, log_ratio.abs(), 0.0).sum(),
        loss_normaliser.float(),
        flagged.sum().float(),
        (silenced & flagged).sum().float(),
        (candidates & flagged).sum().float(),
        rejected.sum().float(),
        weight_sum,
        num_truncated,
    ])


def reduce_metrics(
    losses_reduced: Iterable[Dict[str, torch.Tensor]],
    threshold: torch.Tensor,
    dp_group: Optional[dist.ProcessGroup] = None,
    pp_group: Optional[dist.ProcessGroup] = None,
    pp_last_rank: Optional[int] = None,
) -> Dict[str, float]:
    """Step metrics from the per-micro-batch sums: summed over micro-batches and DP ranks,
    then broadcast from the last pipeline stage (global rank ``pp_last_rank``) over
    ``pp_group`` so every rank can log them. Collective over both groups. The gradient-norm
    sums (``ops.logit_grad``) travel in the same vector (``grad_norm_sums``: a list, for
    `logit_grad.step_metrics`), so they cost no collective of their own.
    """
    # Collectives run on the backend's device (CUDA for NCCL, CPU for gloo); the per-micro-batch
    # sums live on the model's device and are moved there.
    num = len(METRIC_SUMS)
    sums = torch.zeros(num + 1 + logit_grad.SUMS_SIZE,
                       device=collective_device(dp_group if dp_group is not None else pp_group))
    for item in losses_reduced:
        sums[:num] += item["stapo_sums"].to(sums.device)
        sums[num + 1:] += item["grad_norm_sums"].to(sums.device)
    sums[num] = float(threshold)
    if dp_group is not None:
        tau = sums[num].clone()
        dist.all_reduce(sums, group=dp_group)
        sums[num] = tau  # identical on all DP ranks
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.broadcast(sums, src=pp_last_rank, group=pp_group)
    values = sums.tolist()
    total = dict(zip(METRIC_SUMS, values[:num]))
    num_resp = max(total["num_response"], 1.0)
    return {
        "loss": total["loss_sum"] / max(total["loss_normaliser"], 1.0),
        "num_kept": int(total["num_kept"]),
        "num_response_tokens": int(total["num_response"]),
        "silenced_count": int(total["num_silenced"]),
        "silenced_fraction": total["num_silenced"] / num_resp,
        "candidate_count": int(total["num_candidates"]),
        "tau_h": values[num],
        "entropy_mean": total["entropy_sum"] / num_resp,
        "clip_fraction": total["num_clipped"] / max(total["num_kept"], 1.0),
        "approx_kl": total["kl_sum"] / num_resp,
        "logprob_diff_mean": total["abs_logprob_diff_sum"] / num_resp,
        "mismatch_flagged_count": int(total["num_flagged"]),
        "silenced_flagged_count": int(total["num_silenced_flagged"]),
        "candidates_flagged_count": int(total["num_candidates_flagged"]),
        "correction_rejected_count": int(total["num_rejected"]),
        "is_weight_sum": total["is_weight_sum"],
        "is_truncated_count": int(total["num_truncated"]),
        "grad_norm_sums": values[num + 1:],
    }
