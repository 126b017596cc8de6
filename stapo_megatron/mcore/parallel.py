"""Process-group setup for Megatron-Core (torchrun/srun on GPU, gloo on CPU).

The rest of the package takes process groups as arguments; this module is the one place
that initialises ``torch.distributed`` and Megatron's ``parallel_state`` and resolves the
groups a training step needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from stapo_megatron.mcore import cpu_compat
from stapo_megatron.utils import collective_device


@dataclasses.dataclass
class Groups:
    """The process groups one rank needs for a STAPO step."""

    tp: Optional[dist.ProcessGroup]
    """Tensor-parallel group (vocabulary shards of the output layer)."""
    dp: Optional[dist.ProcessGroup]
    """Data-parallel group (the mini-batch is split over it; tau_H is reduced over it)."""
    pp: Optional[dist.ProcessGroup]
    """Pipeline-parallel group (metrics are broadcast from the last stage over it)."""
    is_last_stage: bool
    """Whether this rank holds the output layer (and so computes the loss)."""
    pp_last_rank: int
    """Global rank of the last pipeline stage of this rank's pipeline (metrics source)."""
    mp: Optional[dist.ProcessGroup] = None
    """Model-parallel group (TP x PP): its ranks train on the same samples (the trainer
    broadcasts its first rank's rollouts over it)."""
    cp: Optional[dist.ProcessGroup] = None
    """Context-parallel group: its ranks hold different chunks of the same sequences."""
    dp_cp: Optional[dist.ProcessGroup] = None
    """Data x context parallel group: the ranks over which a mini-batch's tokens are spread, so
    the ones its token statistics (tau_H, the kept-token normaliser, metrics) are reduced over.
    Equal to ``dp`` in membership when CP = 1."""
    ep: Optional[dist.ProcessGroup] = None
    """Expert-model-parallel group (MoE: the experts of a layer are split over it)."""

    @property
    def tokens(self) -> Optional[dist.ProcessGroup]:
        """The group a mini-batch's tokens are spread over: ``dp_cp`` (DP x CP), or ``dp`` when
        that is not set (groups built by hand). Token statistics reduce over it: tau_H's
        candidates, the kept-token normaliser (Megatron's ``finalize_model_grads`` does the
        same), the loss metrics."""
        return self.dp_cp if self.dp_cp is not None else self.dp

    @property
    def cp_size(self) -> int:
        """Context-parallel ranks (1 without a CP group)."""
        return dist.get_world_size(self.cp) if self.cp is not None else 1


INIT_TIMEOUT_S = 180.0
"""Default of `init_process_group`'s ``init_timeout_s`` (`TrainerConfig.init_timeout_s`)."""
DISTRIBUTED_TIMEOUT_S = 600.0
"""Default collective timeout (`TrainerConfig.distributed_timeout_s`; Megatron's 10 minutes)."""


def init_process_group(
    init_timeout_s: float = INIT_TIMEOUT_S,
    timeout_s: float = DISTRIBUTED_TIMEOUT_S,
    backend: Optional[str] = None,
) -> None:
    """Form the default process group from the torchrun environment (no-op when formed).

    Args:
        init_timeout_s: how long this rank waits for all the others to join. A rank that fails
            before joining (bad input on one node, an import error, a lost node) would otherwise
            keep every other rank waiting for the backend's default (gloo: 30 minutes).
        timeout_s: the collectives' timeout once the group has formed (a peer that stops
            answering; a peer that dies closes its connections and is noticed at once).
        backend: "nccl" or "gloo"; default nccl when CUDA is available, else gloo.
    """
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # gloo joins eagerly (every rank waits for all the others' addresses in the store); NCCL
    # joins at the first collective, through the same store and so under the same timeout
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=init_timeout_s))
    # the public API has one timeout for both; torch's _set_pg_timeout (torch >= 2.3) changes
    # the collectives' one afterwards
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))


def init_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    backend: Optional[str] = None,
    init_timeout_s: float = INIT_TIMEOUT_S,
    timeout_s: float = DISTRIBUTED_TIMEOUT_S,
) -> Groups:
    """Initialise torch.distributed (from the torchrun environment) and Megatron parallel state.

    Args:
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size; DP is world_size / (TP * PP * CP).
        seed: RNG seed. Every data-parallel replica must start from the same weights, and
            Megatron draws them from torch's global generators (the CPU one under
            ``use_cpu_initialization``, the CUDA one and the model-parallel tracker on GPU), so
            both are seeded with ``seed + 100 * pp_rank`` (Megatron's own ``_set_random_seed``:
            equal on all DP and TP ranks, distinct per pipeline stage), then the TP-dependent
            streams by ``model_parallel_cuda_manual_seed``.
        context_parallel_size: CP size (each sequence is split over CP ranks).
        expert_model_parallel_size: EP size (MoE experts split over it; Megatron carves it out
            of DP x CP).
        expert_tensor_parallel_size: TP of the experts (None: Megatron's default, TP).
        backend: "nccl" or "gloo"; default nccl when CUDA is available, else gloo.
        init_timeout_s, timeout_s: see `init_process_group` (used when the group is not formed
            yet); ``timeout_s`` is also the timeout of Megatron's groups (whole minutes).
    """
    from megatron.core import parallel_state, tensor_parallel

    cpu_compat.apply()
    init_process_group(init_timeout_s, timeout_s, backend)
    world = dist.get_world_size()
    if world % (tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size):
        raise ValueError(
            f"world size {world} is not divisible by tensor_model_parallel_size "
            f"{tensor_model_parallel_size} x pipeline_model_parallel_size {pipeline_model_parallel_size} "
            f"x context_parallel_size {context_parallel_size}"
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),
    )
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)  # also seeds every CUDA device
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)
    return current_groups()


def group_timeout(group: Optional[dist.ProcessGroup] = None) -> float:
    """The timeout, in seconds, of collectives over ``group`` (None: the default group)."""
    group = group or dist.group.WORLD
    return group._get_backend(collective_device(group)).options._timeout.total_seconds()


@contextlib.contextmanager
def collective_timeout(timeout_s: float, groups: Sequence[Optional[dist.ProcessGroup]]) -> Iterator[None]:
    """Collectives over ``groups`` (None: the default group) wait up to ``timeout_s`` inside the
    block; each group's own timeout is back afterwards. For phases in which ranks legitimately
    wait long for each other (rollouts of 15k-token responses), so that the rest of the step
    keeps ``distributed_timeout_s``. torch's ``_set_pg_timeout`` (torch >= 2.3) applies to the
    collectives issued after it, NCCL's watchdog included."""
    groups = list(dict.fromkeys(g or dist.group.WORLD for g in groups))  # unique, in order
    before = [group_timeout(g) for g in groups]
    for g in groups:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), g)
    try:
        yield
    finally:
        for g, seconds in zip(groups, before):
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), g)


def barrier(group: Optional[dist.ProcessGroup] = None) -> None:
    """``dist.barrier`` on the backend's device (NCCL: the current CUDA device)."""
    device = collective_device(group)
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)


def current_groups() -> Groups:
    """The groups of the already-initialised Megatron parallel state."""
    from megatron.core import parallel_state as ps

    return Groups(
        tp=ps.get_tensor_model_parallel_group(),
        dp=ps.get_data_parallel_group(),
        pp=ps.get_pipeline_model_parallel_group(),
        is_last_stage=ps.is_pipeline_last_stage(),
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        mp=ps.get_model_parallel_group(),
        cp=ps.get_context_parallel_group(),
        dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
        ep=ps.get_expert_model_parallel_group(),
    )


def destroy_parallel() -> None:
    """Tear down Megatron parallel state and the default process group."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
