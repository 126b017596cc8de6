"""The step's rollout/training mismatch (``method.rollout_correction``) over its micro-batches,
reduced over DP x CP, and how much of S2T's selection it overlaps: the mismatch columns of the
step's row (`trainer.step_metrics.step_row`)."""

from __future__ import annotations

import math
from typing import Dict, List

import torch
import torch.distributed as dist

from stapo_megatron.method import rollout_correction as rc
from stapo_megatron.method.masks import gather_values, quantile_linear
from stapo_megatron.method.rollout_correction import RolloutCorrectionConfig
from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.batch.context_parallel import gather_row
from stapo_megatron.batch.packing import sequence_ids
from stapo_megatron.mcore.parallel import Groups


def _whole_sequences(mb: MicroBatch, groups: Groups):
    """(old log-probs, rollout log-probs, response mask, sequence ids) of a micro-batch's whole
    sequences. Under context parallelism the sequence metrics need whole sequences: the fields
    are gathered over CP and counted on CP rank 0 (the others' mask is empty), so a reduction
    over DP x CP counts every token and sequence once."""
    if not mb.is_packed:
        return mb.old_logprob, mb.rollout_logprob, mb.response_mask, None
    if mb.cp_size == 1:
        return mb.old_logprob, mb.rollout_logprob, mb.response_mask, sequence_ids(mb.cu_seqlens)[None]
    whole = [gather_row(t, mb.cu_seqlens, groups.cp) for t in (mb.old_logprob, mb.rollout_logprob, mb.response_mask)]
    if dist.get_rank(groups.cp) != 0:
        whole[2] = torch.zeros_like(whole[2])
    return (*whole, sequence_ids(mb.cu_seqlens)[None])


def rollout_mismatch(minis: List[List[MicroBatch]], config: RolloutCorrectionConfig, groups: Groups,
                     dp_device) -> Dict[str, float]:
    """The step's rollout/training mismatch over its response tokens (after the pi_old pass),
    reduced over DP x CP and the same on every rank (``method.rollout_correction``): mean and max
    |log pi_old - log pi_rollout|, the k3 estimate of KL(pi_rollout || pi_old), quantiles of
    rho = pi_old / pi_rollout, and the fractions of tokens and sequences outside the bounds."""
    num_q = len(rc.RATIO_QUANTILES)
    packed = torch.zeros(len(rc.MISMATCH_SUMS) + 1 + num_q, dtype=torch.float64, device=dp_device)
    if groups.is_last_stage:
        parts = [rc.mismatch_sums(config, *_whole_sequences(mb, groups)) for mini in minis for mb in mini]
        sums = torch.stack([p[0] for p in parts]).sum(0).to(dp_device)
        max_abs = torch.stack([p[1] for p in parts]).max().reshape(1).to(dp_device)
        ratios = torch.cat([p[2] for p in parts]).to(dp_device)
        if groups.tokens is not None:
            dist.all_reduce(sums, group=groups.tokens)
            dist.all_reduce(max_abs, op=dist.ReduceOp.MAX, group=groups.tokens)
        pooled = gather_values(ratios, groups.tokens)
        quantiles = torch.stack([quantile_linear(pooled, q) for q in rc.RATIO_QUANTILES]).double().to(dp_device)
        packed = torch.cat([sums, max_abs, quantiles])
    if groups.pp is not None and dist.get_world_size(groups.pp) > 1:
        dist.broadcast(packed, src=groups.pp_last_rank, group=groups.pp)
    values = packed.tolist()
    total = dict(zip(rc.MISMATCH_SUMS, values))
    tokens, seqs = total["num_response"], total["num_sequences"]
    per_token = lambda key: total[key] / tokens if tokens else math.nan  # noqa: E731
    row = dict(
        rollout_train_logprob_diff=per_token("abs_delta_sum"),
        mismatch_abs_logprob_diff_max=values[len(rc.MISMATCH_SUMS)] if tokens else math.nan,
        mismatch_k3_kl=per_token("k3_sum"),
        mismatch_token_flagged_fraction=per_token("num_token_flagged"),
        mismatch_seq_flagged_fraction=total["num_seq_flagged"] / seqs if seqs else math.nan,
    )
    for q, value in zip(rc.RATIO_QUANTILES, values[len(rc.MISMATCH_SUMS) + 1:]):
        row[f"mismatch_ratio_q{round(100 * q):02d}"] = value
    return row


def overlap_metrics(updates: List[Dict]) -> Dict[str, float]:
    """How much of S2T's selection is mismatch: silenced tokens and candidates that are also
    mismatch-flagged (counts, and fractions of the silenced / candidate tokens), and what the
    correction did (rejected fraction of response tokens, mean IS weight of the kept tokens,
    fraction truncated at the cap), summed over the step's mini-batch updates."""
    total = lambda key: sum(u[key] for u in updates)  # noqa: E731
    silenced, candidates, kept = total("silenced_count"), total("candidate_count"), total("num_kept")
    return dict(
        mismatch_flagged_count=total("mismatch_flagged_count"),
        silenced_flagged_count=total("silenced_flagged_count"),
        silenced_flagged_fraction=total("silenced_flagged_count") / silenced if silenced else math.nan,
        candidates_flagged_count=total("candidates_flagged_count"),
        candidates_flagged_fraction=total("candidates_flagged_count") / candidates if candidates else math.nan,
        correction_rejected_fraction=total("correction_rejected_count") / max(total("num_response_tokens"), 1),
        is_weight_mean=total("is_weight_sum") / kept if kept else math.nan,
        is_truncated_fraction=total("is_truncated_count") / kept if kept else math.nan,
    )
