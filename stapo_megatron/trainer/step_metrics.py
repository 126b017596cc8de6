"""A training step's metrics row: phase timings, rollout sums over DP, the updates' metrics, the
train/rollout log-prob mismatch, and the line printed per step."""

from __future__ import annotations

import math
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from stapo_megatron.runlog.progress import describe
from stapo_megatron.train.batching import MicroBatch
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


def reduce_from_last_stage(values: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Sum a last-stage tensor over DP, then broadcast it over PP: the same on every rank."""
    if groups.is_last_stage and groups.dp is not None:
        dist.all_reduce(values, group=groups.dp)
    if groups.pp is not None and dist.get_world_size(groups.pp) > 1:
        dist.broadcast(values, src=groups.pp_last_rank, group=groups.pp)
    return values


def rollout_train_logprob_diff(minis: List[List[MicroBatch]], groups: Groups, device, dp_device) -> torch.Tensor:
    """[sum |log pi_old - log pi_rollout|, response tokens] over the step's micro-batches (after
    the pi_old pass), the same on every rank."""
    diff = torch.zeros(2, device=device)
    if groups.is_last_stage:
        for mini in minis:
            for mb in mini:
                mask = mb.response_mask
                diff += torch.stack([(mb.old_logprob - mb.rollout_logprob).abs()[mask].sum(), mask.sum().float()])
    return reduce_from_last_stage(diff.to(dp_device), groups)


def step_row(step: int, updates: List[Dict], rewards_PG: torch.Tensor, num_flat: int, samples, diff: torch.Tensor,
             reward_info: Dict, tau_h_source: str, lr: float, groups: Groups, dp_device) -> Dict:
    """The step's metrics row: rollout sums over DP, the mini-batch updates' metrics."""
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
        rollout_train_logprob_diff=float(diff[0] / diff[1]) if diff[1] > 0 else math.nan,
        lr=lr,
    )


def format_row(r: Dict, steps: int) -> str:
    """The line printed after a training step."""
    return (
        f"step {describe(r, steps)} | reward {r['reward_mean']:.3f} | entropy {r['entropy_mean']:.3f} | "
        f"silenced {r['silenced_count']} ({r['silenced_fraction']:.4%}) tau_H {r['tau_h']:.3f} | "
        f"loss {r['loss']:+.4f} clip {r['clip_fraction']:.3f} | len {r['response_len_mean']:.1f} | "
        f"rollout {r['time_rollout']:.1f}s reward {r['time_reward']:.1f}s old {r['time_old_logprob']:.1f}s "
        f"train {r['time_train']:.1f}s sync {r['time_weight_sync']:.1f}s"
    )


def gather_silenced(rows: List, groups: Groups) -> List:
    """Silenced-token rows of all DP ranks (from TP rank 0 of the last stage) on rank 0."""
    mine = rows if (groups.is_last_stage and dist.get_rank(groups.tp) == 0) else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [r for part in gathered for r in part]
