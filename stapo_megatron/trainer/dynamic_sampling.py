"""DAPO's dynamic sampling ("filter groups", arXiv 2503.14476) over streaming rollouts
(``rollout.streaming.filter_groups``): a step's groups whose G rewards are all equal carry no advantage,
so no gradient; they are dropped and replaced by groups of further prompts until the step has P
informative groups, as DAPO keeps sampling until its batch is full.

The replacements come from the engines' streams ahead of the queued steps
(`stapo_megatron.trainer.pooled_schedules.StreamingSchedule.replace`: the replica's replacement
prompts, a part of its data order no step trains), so a step waits for them only as long as their
groups take to complete. A round replaces every uniform group at once; after ``filter_rounds``
rounds the groups still uniform train as they would without the filter (their advantages are
zero). Every training rank takes part in the same rounds (the replacement request is collective):
a replica with nothing to replace asks for no groups.

Each step logs, over the DP replicas: ``filter_dropped_groups`` (groups dropped),
``filter_drop_rate`` (their share of the groups generated for the step), ``filter_rounds`` (the
rounds run) and ``filter_uniform_left`` (uniform groups trained after the last round).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.batch.step_rollout import StepRollout

Score = Callable[[StepRollout], Tuple[torch.Tensor, Dict]]
"""The trainer's scoring: a record's rewards [P, G] and the scorer's counts."""
Replace = Callable[[List[int], int], Optional[StepRollout]]
"""``replace(slots, round_index)``: the groups replacing the record's groups at ``slots``."""


def uniform_groups(rewards_PG: torch.Tensor) -> List[int]:
    """The groups whose G rewards are all equal."""
    return [p for p in range(rewards_PG.shape[0]) if bool((rewards_PG[p] == rewards_PG[p, 0]).all())]


def fill_informative(rollout: StepRollout, rewards_PG: torch.Tensor, info: Dict, replace: Replace, score: Score,
                     max_rounds: int, dp_group, device) -> Tuple[StepRollout, torch.Tensor, Dict, Dict[str, float]]:
    """The step's record with its uniform groups replaced (module docstring): the record, its
    rewards [P, G], the scorer's counts over every group scored, and the step's filter metrics."""
    rewards = list(rewards_PG)
    dropped = rounds = 0
    for round_index in range(max_rounds):
        slots = uniform_groups(torch.stack(rewards))
        wanted = torch.tensor([len(slots)], dtype=torch.float64, device=device)
        dist.all_reduce(wanted)  # every training rank: the same rounds on all of them
        if wanted.item() == 0:
            break
        extra = replace(slots, round_index)
        rounds += 1
        if extra is None:
            continue
        extra_rewards, extra_info = score(extra)
        info = {k: info.get(k, 0) + extra_info.get(k, 0) for k in {*info, *extra_info}}
        for p, (slot, group) in enumerate(zip(slots, extra.groups(), strict=True)):
            rollout = rollout.replace_group(slot, group)
            rewards[slot] = extra_rewards[p]
        dropped += len(slots)
    rewards_PG = torch.stack(rewards)
    sums = torch.tensor([dropped, rollout.num_prompts, len(uniform_groups(rewards_PG))], dtype=torch.float64,
                        device=device)
    most = torch.tensor([rounds], dtype=torch.float64, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(sums, group=dp_group)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=dp_group)
    dropped_all, trained_all, left = sums.tolist()
    metrics = dict(filter_dropped_groups=dropped_all, filter_drop_rate=dropped_all / (dropped_all + trained_all),
                   filter_rounds=most.item(), filter_uniform_left=left)
    return rollout, rewards_PG, info, metrics
