"""The data-parallel replicas a run trains on: Megatron's process groups from `ModelConfig` (TP,
PP, CP, EP), checked on the job's world size by the one validator
(`stapo_megatron.config.parallel_layout`), the alignments of the replica's rows
(`stapo_megatron.batch.alignment`), and how the context-parallel (CP) ranks of one replica share
its rollouts.

Rollouts under CP: the CP ranks of a DP replica train the same sequences (each its chunks of
them), so they need the same samples. Rather than every CP rank's engine sampling all of the
replica's prompts (CP - 1 of them wasted), CP rank c samples the c-th 1/CP of the replica's
prompts (with the seeds those samples have without CP;
`stapo_megatron.rollout.spmd.generate_context_parallel_share`), and the parts are all-gathered
over the CP group: generation is spread over DP x CP, at the cost of one object all-gather of the
samples per step. Evaluation is spread the same way (`stapo_megatron.eval.evaluator`), without
the all-gather: each CP rank scores its share and the counts are reduced over DP x CP.
"""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist

from stapo_megatron.config import TrainerConfig
from stapo_megatron.batch.alignment import row_multiple, sequence_multiple
from stapo_megatron.config.parallel_layout import raise_problems, world_problems
from stapo_megatron.rollout.config import SamplingSettings
from stapo_megatron.rollout.spmd import generate_context_parallel_share, shared_over_group
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.mcore.parallel import Groups, init_parallel


def init_groups(cfg: TrainerConfig, seed: int) -> Groups:
    """Initialise torch.distributed and Megatron's parallel state for ``cfg.model``'s layout,
    then check the layout on the job's world size (`config.parallel_layout.world_problems`: the prompts
    over DP and over a replica's CP ranks, the expert groups; one ValueError naming them all)."""
    m = cfg.model
    groups = init_parallel(
        m.tensor_model_parallel_size, m.pipeline_model_parallel_size, seed=seed,
        context_parallel_size=m.context_parallel_size, expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        init_timeout_s=cfg.init_timeout_s, timeout_s=cfg.distributed_timeout_s,
    )
    job = dist.get_world_size() + cfg.rollout.separate.engine_ranks  # separate modes: the engines' ranks too
    raise_problems(world_problems(cfg, job), f"the layout cannot run on {job} ranks")
    return groups


def seq_align(m: ModelConfig) -> int:
    """Every packed sequence's length is padded to a multiple of this (2 x CP chunks, each
    rank's part split over TP by sequence parallelism; 1 without CP)."""
    return sequence_multiple(m.context_parallel_size, m.tensor_model_parallel_size, m.sequence_parallel)


def seq_multiple(m: ModelConfig) -> int:
    """A padded batch's length, or a packed row's, is a multiple of this (`batch.alignment.row_multiple`)."""
    return row_multiple(m.context_parallel_size, m.tensor_model_parallel_size, m.sequence_parallel)


def replica_rollout(engine, groups: Groups, prompts: List[List[int]], settings: SamplingSettings,
                    wait_timeout_s: Optional[float]) -> List[List]:
    """``settings.n`` samples for each of this DP replica's prompts, identical on all its ranks.

    Without CP: `generate_for_group` (model-parallel rank 0's samples broadcast). With CP:
    CP rank c samples prompts [c P / CP, (c + 1) P / CP) (first sample seed ``settings.seed +
    c P / CP x n``, as without CP: `generate_context_parallel_share`), then the parts are
    all-gathered over CP in rank order."""
    _, mine = generate_context_parallel_share(engine, groups, prompts, settings, wait_timeout_s)
    return _gather_context_parallel(groups, mine)


def _gather_context_parallel(groups: Groups, mine: List[List]) -> List[List]:
    """A replica's samples from its CP ranks' shares, in rank order (the share itself without CP)."""
    if groups.cp_size == 1:
        return mine
    parts: List[Optional[List]] = [None] * groups.cp_size
    dist.all_gather_object(parts, mine, group=groups.cp)
    return [group for part in parts for group in part]


def replica_submit(engine, groups: Groups, prompts: List[List[int]], settings: SamplingSettings):
    """`replica_rollout`'s first half with separate placement: this CP rank's share of the
    replica's prompts queued at the engines (`stapo_megatron.rollout.remote.RemoteEngine.submit`,
    same seeds); returns the ticket `replica_receive` takes."""
    cp, rank = groups.cp_size, dist.get_rank(groups.cp) if groups.cp is not None else 0
    start, end = len(prompts) * rank // cp, len(prompts) * (rank + 1) // cp
    return engine.submit(prompts[start:end], settings.skip(start))  # the share's seeds in the whole request


def replica_receive(engine, groups: Groups, ticket, wait_timeout_s: Optional[float]) -> List[List]:
    """`replica_rollout`'s second half: the samples of ``ticket``, identical on the replica's ranks."""
    return _gather_context_parallel(groups, shared_over_group(lambda: engine.receive(ticket), groups.mp,
                                                              wait_timeout_s))
