"""A training step's metrics row: phase timings, rollout sums over DP, the updates' metrics (with
the rollout/training mismatch of `trainer.mismatch_metrics`), the line printed per step, and the
stop after too many skipped steps (`SkipGuard`)."""

from __future__ import annotations

import time
from typing import Dict, List

import torch
import torch.distributed as dist

from stapo_megatron.runlog.progress import describe
from stapo_megatron.ops import logit_grad
from stapo_megatron.mcore.checkpoint import find_latest
from stapo_megatron.mcore.parallel import Groups
from stapo_megatron.trainer.mismatch_metrics import overlap_metrics


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


def step_row(step: int, updates: List[Dict], rewards_PG: torch.Tensor, num_flat: int, response_tokens: int,
             mismatch: Dict, reward_info: Dict, tau_h_source: str, lr: float, groups: Groups, dp_device) -> Dict:
    """The step's metrics row: rollout sums over DP (``response_tokens``: this rank's, the step
    record's `StepRollout.response_tokens`), the mini-batch updates' metrics, the rollout/training
    mismatch (``rollout_mismatch``) and its overlap with S2T."""
    sums = torch.tensor([
        float(rewards_PG.sum()), float(rewards_PG.numel()), float(num_flat), float(rewards_PG.shape[0]),
        float(response_tokens), float(reward_info.get("num_timeouts", 0)),
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
        **logit_grad.step_metrics(updates),  # the paper's gradient claim (ops/logit_grad.py)
    )


def moe_metrics(updates: List[Dict]) -> Dict[str, float]:
    """MoE models: the mini-batch updates' ``moe/...`` metrics (`stapo_megatron.mcore.moe`:
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
        f"train {r['time_train']:.1f}s sync {r['time_weight_sync']:.1f}s{routing}{_placement(r)}"
    )


def _placement(r: Dict) -> str:
    """Separate placement's part of the line: staleness, and rank 0's engine's busy/idle seconds."""
    if "time_engine_generate" not in r:
        return ""
    return (f" | stale {r['staleness']:.0f} engine gen {r['time_engine_generate']:.1f}s "
            f"idle {r['time_engine_idle']:.1f}s load {r['time_engine_load']:.1f}s")


def gather_silenced(rows: List, groups: Groups) -> List:
    """Silenced-token rows of all DP ranks (from TP rank 0 of the last stage) on rank 0."""
    mine = rows if (groups.is_last_stage and dist.get_rank(groups.tp) == 0) else []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [r for part in gathered for r in part]


class SkipGuard:
    """Stops a run whose steps keep being skipped (a NaN/Inf loss or gradient, `policy_update`)."""

    def __init__(self, limit: int, run_dir: str):
        self.limit, self.run_dir, self.consecutive = limit, run_dir, 0

    def check(self, row: Dict, step: int) -> None:
        """Count ``row``'s skip; RuntimeError after more than ``limit`` in a row."""
        self.consecutive = self.consecutive + 1 if row["skipped"] else 0
        if self.consecutive > self.limit:
            raise RuntimeError(
                f"{self.consecutive} consecutive steps had a NaN/Inf loss or gradient (last at step "
                f"{step + 1}); stopping. Check the learning rate and the data; the last good "
                f"checkpoint is {find_latest(self.run_dir)}"
            )
