"""How the training ranks share rollouts (SPMD): one engine's samples broadcast over its
model-parallel group (`generate_for_group`) and a data-parallel replica's prompts spread over its
context-parallel ranks (`generate_context_parallel_share`).

Every rank of the job calls these collectively; the engine itself (`stapo_megatron.rollout.base.
RolloutEngine`) knows nothing of the process groups.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Tuple

import torch.distributed as dist

from stapo_megatron.rollout.base import RolloutEngine, Sample
from stapo_megatron.rollout.config import SamplingSettings
from stapo_megatron.mcore.parallel import Groups, barrier, collective_timeout


def generate_for_group(engine: RolloutEngine, mp_group: Optional[dist.ProcessGroup], prompt_token_ids,
                       settings: SamplingSettings, wait_timeout_s: Optional[float] = None) -> list[list[Sample]]:
    """``engine.generate`` with ``settings`` (`SamplingSettings.generate`), then the group's
    first rank's samples broadcast over ``mp_group``: every rank of a model-parallel group must
    train (and be scored) on identical samples.

    ``wait_timeout_s``: every rank of the job (all must call this) then waits here for all the
    others' samples, and this call's collectives wait up to ``wait_timeout_s`` instead of the
    groups' own timeout: the wait for the slowest engine (a 15k-token response) happens here,
    not in the next collective under ``TrainerConfig.distributed_timeout_s``."""
    return shared_over_group(lambda: settings.generate(engine, prompt_token_ids), mp_group, wait_timeout_s)


def shared_over_group(produce: Callable[[], list], mp_group: Optional[dist.ProcessGroup],
                      wait_timeout_s: Optional[float] = None) -> list:
    """``produce()`` (an engine's samples) on every rank, then the group's first rank's result
    broadcast over ``mp_group``; with ``wait_timeout_s`` under that timeout and followed by a
    job-wide barrier (`generate_for_group`). Also how `stapo_megatron.rollout.remote.RemoteEngine`'s
    samples reach a model-parallel group (only its first rank receives them)."""
    waiting = wait_timeout_s is not None and dist.is_initialized()
    with collective_timeout(wait_timeout_s, [None, mp_group]) if waiting else contextlib.nullcontext():
        samples = produce()
        if mp_group is not None and dist.get_world_size(mp_group) > 1:
            box = [samples]
            dist.broadcast_object_list(box, src=dist.get_process_group_ranks(mp_group)[0], group=mp_group)
            samples = box[0]
        if waiting:
            barrier()
    return samples


def generate_context_parallel_share(engine: RolloutEngine, groups: Groups, prompt_token_ids,
                                    settings: SamplingSettings,
                                    wait_timeout_s: Optional[float] = None) -> Tuple[int, list[list[Sample]]]:
    """This context-parallel rank's share of a data-parallel replica's prompts, sampled with the
    seeds those prompts have without CP (`generate_for_group` over ``groups.mp``).

    The CP ranks of a replica hold the same prompts; rather than each sampling all of them (CP - 1
    copies wasted), CP rank c of CP samples prompts [c P // CP, (c + 1) P // CP) of the P (shares
    differ by at most one; one may be empty), prompt i's j-th sample seeded ``settings.seed + i *
    n + j`` as in one call over all P (`SamplingSettings.skip`). Without CP that is all P prompts.
    Every rank of the job calls this.

    Returns:
        ``(start, samples)``: the index of the share's first prompt in ``prompt_token_ids`` and
        its samples (``samples[i]`` belongs to prompt ``start + i``).
    """
    cp, rank = groups.cp_size, dist.get_rank(groups.cp) if groups.cp is not None else 0
    start, end = len(prompt_token_ids) * rank // cp, len(prompt_token_ids) * (rank + 1) // cp
    samples = generate_for_group(engine, groups.mp, prompt_token_ids[start:end], settings.skip(start),
                                 wait_timeout_s=wait_timeout_s)
    return start, samples
