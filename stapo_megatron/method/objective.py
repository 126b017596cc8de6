"""The policy loss of every objective on plain tensors: the per-token clipped surrogate and the
masked sum of an objective's token losses (`policy_loss` of a micro-batch's `PolicyTokens`,
configured by a `PolicyLossConfig`).

arXiv 2602.15620, the J_STAPO objective (DAPO/JustRL token level, clip-higher, no KL, no entropy
bonus, plus the S2T mask of ``stapo_megatron.method.masks``; docs/design.md, "The method"):

    J = 1 / sum keep * sum_{i,t} keep_{i,t} * min( r A_i , clip(r, 1 - eps_low, 1 + eps_high) A_i )
    r = pi_theta(y_t | .) / pi_old(y_t | .),   keep = response_mask & ~silenced

Pure tensors in, (sum of token losses, number of kept tokens) out: the division by the kept count
of the whole mini-batch (all micro-batches, all DP ranks) is Megatron's, see
``stapo_megatron.mcore.loss``. No process groups, no Megatron.

GRPO as DeepSeekMath defines it (Shao et al. 2024, Eq. 3) aggregates differently
(``loss_agg="seq_mean_token_mean"``): each sequence's token losses are averaged over its own
length first, then sequences are averaged,

    J_GRPO = 1/G sum_i 1/|o_i| sum_t [ min(r A_i, clip(r, 1 - eps, 1 + eps) A_i) - beta D_KL,t ]
    D_KL,t = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1        (the k3 estimator)

so the call returns (sum over sequences of their mean token loss, number of sequences) and the
same Megatron division by the mini-batch's total gives the mean over sequences.

Legend: [B, S] = micro-batch x sequence, aligned with the labels.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

import torch

SequenceSum = Callable[[torch.Tensor], torch.Tensor]
"""Sums a per-sequence tensor [N] over the ranks that hold the other parts of the same sequences
(context parallelism: an all-reduce over the CP group, ``batch.context_parallel.cp_sum``)."""

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean")
"""How token losses are averaged: over all kept tokens of the mini-batch (DAPO/JustRL, STAPO) or
per sequence, then over sequences (DeepSeekMath GRPO)."""

TokenLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logprob, old_logprob, advantages, keep) -> per-token loss [B, S]`` of an objective
(`PolicyLossConfig.token_loss`; ``method.objectives`` builds them)."""


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """How `policy_loss` turns token log-probs into the loss: the objective's token loss, the
    KL term and the aggregation (built per micro-batch from `LossConfig` and the objective)."""

    clip_ratio_low: float = 0.2
    """eps_low of the clipped surrogate (`token_objective`)."""
    clip_ratio_high: float = 0.28
    """eps_high (clip-higher)."""
    clip_ratio_c: Optional[float] = None
    """Dual-clip bound c for A < 0 (None: no dual clip)."""
    kl_coef: float = 0.0
    """beta of the k3 KL term to the reference (needs ``ref_logprob``; 0: none)."""
    loss_agg: str = "token_mean"
    """One of `LOSS_AGGREGATIONS`."""
    token_loss: Optional[TokenLoss] = None
    """Another objective's per-token loss (``method.objectives``; the clip fields are then its
    business); None: the clipped surrogate (`token_objective`)."""

    def __post_init__(self):
        if self.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGREGATIONS}, got {self.loss_agg!r}")


def token_objective(
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss -min(r A, clip(r) A) and whether clipping was active."""
    ratio = torch.exp(logprob - old_logprob)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high) * advantages
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if clip_ratio_c is not None:
        # Dual clip (Ye et al. 2020): for A < 0 bound the loss by -c A.
        dual = torch.minimum(loss, -clip_ratio_c * advantages)
        loss = torch.where(advantages < 0, dual, loss)
    return loss, is_clipped


@dataclasses.dataclass(frozen=True)
class PolicyTokens:
    """One micro-batch's per-token tensors that `policy_loss` reads, each [B, S] like
    ``logprob`` (checked when the record is built).

    Raises:
        ValueError: a tensor's shape differs from ``logprob``'s (a [B] advantage would broadcast
            along the token axis when B == S; a [B, S, 1] mask would multiply the kept count),
            or a mask is not bool; the message names the field.
    """

    logprob: torch.Tensor
    """log pi_theta of the labels (any float dtype; the loss is computed in at least fp32, so
    fp16/bf16 inputs do not overflow the sum, and float64 inputs keep float64)."""
    old_logprob: torch.Tensor
    """log pi_old of the labels."""
    advantages: torch.Tensor
    """Per-token advantages (a sequence's advantage broadcast over its tokens,
    ``adv_B[:, None].expand(B, S)``)."""
    response_mask: torch.Tensor
    """bool: the response tokens the loss may train (the rollout correction's rejected ones out)."""
    silenced: torch.Tensor
    """bool: the method's mask (keep = response_mask & ~silenced)."""
    ref_logprob: Optional[torch.Tensor] = None
    """log pi_ref of the labels, for the k3 KL term (``PolicyLossConfig.kl_coef`` > 0)."""
    is_weight: Optional[torch.Tensor] = None
    """Constant importance weight of each token's objective term (the rollout correction's
    truncated IS, ``method.rollout_correction``; verl multiplies its pg_losses the same way):
    the KL term and the normaliser are not weighted. None = 1."""
    sequence_ids: Optional[torch.Tensor] = None
    """For a packed row (several sequences in one row), the sequence index of every token
    (``batch.packing.sequence_ids``); only "seq_mean_token_mean" reads it. None: a row is a
    sequence."""

    def __post_init__(self):
        tensors = {"old_logprob": self.old_logprob, "advantages": self.advantages,
                   "response_mask": self.response_mask, "silenced": self.silenced}
        if self.ref_logprob is not None:
            tensors["ref_logprob"] = self.ref_logprob
        if self.is_weight is not None:
            tensors["is_weight"] = self.is_weight
        for name, t in tensors.items():
            if t.shape != self.logprob.shape:
                hint = ""
                if name == "advantages":
                    hint = (" (advantages are per token: expand a per-sequence [B] advantage with "
                            "adv[:, None].expand_as(logprob))")
                raise ValueError(f"{name} has shape {list(t.shape)} but logprob has {list(self.logprob.shape)}{hint}")
        for name in ("response_mask", "silenced"):
            if tensors[name].dtype != torch.bool:
                raise ValueError(f"{name} must be a bool tensor, got {tensors[name].dtype}")


def policy_loss(
    tokens: PolicyTokens,
    config: PolicyLossConfig = PolicyLossConfig(),
    sequence_sum: Optional[SequenceSum] = None,
    count_sequences: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sum of the objective's token losses over kept tokens, and the number of kept tokens.

    keep = response_mask & ~silenced; loss_sum = -sum keep * min(r A, clip(r, 1-eps_low,
    1+eps_high) A) (or ``config.token_loss``; times ``is_weight``; + kl_coef * k3 KL to
    ``ref_logprob`` per kept token if kl_coef > 0). Dividing by the kept count of the whole
    mini-batch (not by this call's) gives -J.

    Args:
        tokens: the micro-batch's per-token tensors (`PolicyTokens`).
        config: the token loss, KL term and aggregation. Its ``loss_agg``: "token_mean"
            (DAPO/JustRL: every kept token weighs the same) or
            "seq_mean_token_mean" (GRPO: mean over each sequence's kept tokens, then over
            sequences; one row of the [B, S] tensors is one sequence, unless
            ``tokens.sequence_ids``).
        sequence_sum, count_sequences: context parallelism ("seq_mean_token_mean" with
            ``sequence_ids``): the rows hold only this rank's part of every sequence.
            ``sequence_sum`` adds the per-sequence kept-token counts over the ranks holding the
            other parts, so |o_i| is the whole sequence's and the rank's loss sum is its share
            of sum_i 1/|o_i| sum_t l_t; the normaliser counts the sequences only where
            ``count_sequences`` (one rank of the group), so a sum over the group counts each
            once. None / True: the rows hold whole sequences.

    Returns:
        (loss_sum: 0-dim, fp32 or (float64 inputs) float64, differentiable; the normaliser: 0-dim int64, the number of kept
        tokens, or with "seq_mean_token_mean" the number of sequences with a kept token).

    Raises:
        ValueError: ``kl_coef`` > 0 without ``tokens.ref_logprob``.
    """
    loss_agg, kl_coef = config.loss_agg, config.kl_coef
    logprob, old_logprob, advantages = tokens.logprob, tokens.old_logprob, tokens.advantages
    # accumulate in at least fp32: half-precision inputs go up, float64 inputs stay float64
    dtype = torch.promote_types(torch.promote_types(logprob.dtype, old_logprob.dtype),
                                torch.promote_types(advantages.dtype, torch.float32))
    logprob, old_logprob, advantages = logprob.to(dtype), old_logprob.to(dtype), advantages.to(dtype)
    ref_logprob = None if tokens.ref_logprob is None else tokens.ref_logprob.to(dtype)
    keep = tokens.response_mask & ~tokens.silenced
    if config.token_loss is not None:
        loss = config.token_loss(logprob, old_logprob, advantages, keep)
    else:
        loss, _ = token_objective(logprob, old_logprob, advantages, config.clip_ratio_low, config.clip_ratio_high,
                                  config.clip_ratio_c)
    if tokens.is_weight is not None:
        loss = loss * tokens.is_weight.detach().to(loss.dtype)  # float64 weights stay float64
    if kl_coef:
        if ref_logprob is None:
            raise ValueError("kl_coef > 0 needs ref_logprob")
        log_ratio_ref = ref_logprob - logprob
        loss = loss + kl_coef * (torch.expm1(log_ratio_ref) - log_ratio_ref)
    # where() rather than a multiply: a silenced token's inf/NaN ratio must not leak into the sum.
    loss_BS = torch.where(keep, loss, 0.0)
    sequence_ids = tokens.sequence_ids
    if loss_agg == "seq_mean_token_mean" and sequence_ids is not None:
        ids_T = sequence_ids.reshape(-1)
        num_seq = int(ids_T.max()) + 1
        sums_N = loss_BS.new_zeros(num_seq).index_add(0, ids_T, loss_BS.reshape(-1))
        num_kept_N = torch.zeros(num_seq, dtype=torch.long, device=ids_T.device).index_add(
            0, ids_T, keep.reshape(-1).long())
        if sequence_sum is not None:  # counts only: no gradient flows through |o_i|
            num_kept_N = sequence_sum(num_kept_N)
        num_seq_kept = (num_kept_N > 0).sum() if count_sequences else num_kept_N.new_zeros(())
        return (sums_N / num_kept_N.clamp(min=1)).sum(), num_seq_kept
    if loss_agg == "seq_mean_token_mean":
        if sequence_sum is not None:
            raise ValueError("sequence_sum (a sequence split over ranks) needs the packed row's sequence_ids")
        num_kept_B = keep.sum(dim=-1)
        has_kept_B = num_kept_B > 0
        # clamp: a row without kept tokens has a zero sum; dividing it by 1 keeps it zero, not NaN
        return (loss_BS.sum(dim=-1) / num_kept_B.clamp(min=1)).sum(), has_kept_B.sum()
    return loss_BS.sum(), keep.sum()
