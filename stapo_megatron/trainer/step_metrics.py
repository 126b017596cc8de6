"""A training step's metrics row: phase timings, rollout sums over DP, the updates' metrics, the
rollout/training mismatch and its overlap with S2T, and the line printed per step."""

from __future__ import annotations

import math
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from stapo_megatron.method import rollout_correction as rc
from stapo_megatron.method.masks import gather_values, quantile_linear
from stapo_megatron.method.rollout_correction import RolloutCorrectionConfig
from stapo_megatron.runlog.progress import describe
from stapo_megatron.train.batching import MicroBatch
from stapo_megatron.train import logit_grad
from stapo_megatron.train.context_parallel import gather_row
from stapo_megatron.train.packing import sequence_ids
from stapo_megatron.train.parallel import Groups


class Timer:
    """``with timer("rollout"): ...`` adds the block's seconds to ``seconds["time_rollout"]``."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}

    def __call__(self, name):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.seconds[f"time_{name}"] = timer.seconds.get(f"time_{name}", 0.0) + time.perf_counter() - self.t0

        return _Ctx()


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


def step_row(step: int, updates: List[Dict], rewards_PG: torch.Tensor, num_flat: int, samples, mismatch: Dict,
             reward_info: Dict, tau_h_source: str, lr: float, groups: Groups, dp_device) -> Dict:
    """The step's metrics row: rollout sums over DP, the mini-batch updates' metrics, the
    rollout/training mismatch (``rollout_mismatch``) and its overlap with S2T."""
    sums = torch.tensor([
        float(rewards_PG.sum()), float(rewards_PG.numel()), float(num_flat), float(rewards_PG.shape[0]),
        float(sum(len(s.token_ids) for group in samples for s in group)), float(reward_info.get("num_timeouts", 0)),
    ], device=dp_device)
    dist.all_reduce(sums, group=groups.dp)
    mean = lambda key: sum(u[key] for u in updates) / len(updates)  # noqa: E731
    silenced = sum(u["silenced_count"] for u in updates)
    response_tokens = sum(u["num_response_tokens"] for u in updates)
    return dict(
        kind="train", step=step + 1,
        reward_mean=float(sums[0] / sums[1]),
        flat_groups=int(sums[2]), num_prompts=int(sums[3]),
        response_len_mean=float(sums[4] / sums[1]),
        reward_timeouts=int(sums[5]),
        loss=mean("loss"), entropy_mean=mean("entropy_mean"),
        silenced_count=silenced, silenced_fraction=silenced / max(response_tokens, 1),
        tau_h=mean("tau_h"), tau_h_source=tau_h_source,
        candidate_count=sum(u["candidate_count"] for u in updates),
        clip_fraction=mean("clip_fraction"), approx_kl=mean("approx_kl"),
        grad_norm=mean("grad_norm"), skipped=sum(u["skipped"] for u in updates),
        lr=lr, **mismatch, **overlap_metrics(updates), **moe_metrics(updates),
        **logit_grad.step_metrics(updates),  # the paper's gradient claim (train/logit_grad.py)
    )


def moe_metrics(updates: List[Dict]) -> Dict[str, float]:
    """MoE models: the mini-batch updates' ``moe/...`` metrics (`stapo_megatron.train.moe`:
    per-layer expert load and aux loss), averaged over the step's mini-batches; {} when dense."""
    keys = [k for k in updates[0] if k.startswith("moe/")] if updates else []
    return {k: sum(u[k] for u in updates) / len(updates) for k in keys}


def format_row(r: Dict, steps: int) -> str:
    """The line printed after a training step (MoE: with the routing disagreement when measured)."""
    routing = (f" | routing diff {r['routing_disagreement_mean']:.2%} max {r['routing_disagreement_max']:.2%} "
               f"load {r['rollout_expert_load_max']:.2f}" if "routing_disagreement_mean" in r else "")
    return (
        f"step {describe(r, steps)} | reward {r['reward_mean']:.3f} | entropy {r['entropy_mean']:.3f} | "
        f"silenced {r['silenced_count']} ({r['silenced_fraction']:.4%}) tau_H {r['tau_h']:.3f} | "
        f"loss {r['loss']:+.4f} clip {r['clip_fraction']:.3f} | len {r['response_len_mean']:.1f} | "
        f"|dlogp| {r['rollout_train_logprob_diff']:.1e} max {r['mismatch_abs_logprob_diff_max']:.1e} "
        f"flagged {r['mismatch_token_flagged_fraction']:.2%} (silenced {r['silenced_flagged_count']}) | "
        f"rollout {r['time_rollout']:.1f}s reward {r['time_reward']:.1f}s old {r['time_old_logprob']:.1f}s "
        f"train {r['time_train']:.1f}s sync {r['time_weight_sync']:.1f}s{routing}"
    )


def gather_silenced(rows: List, groups: Groups) -> List:
    """Silenced-token rows of all DP ranks (from TP rank 0 of the last stage) on rank 0."""
    mine = rows if (groups.is_last_stage and dist.get_rank(groups.tp) == 0) else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [r for part in gathered for r in part]
