"""Context parallelism (CP) on packed rows: the load-balanced split of every sequence over the CP
ranks, its inverse, and the K/V all-gather of the local-spec attention.

The split (Megatron's THD convention with CP, ``rope_utils._get_thd_freqs_on_this_cp_rank``;
verl, NeMo-RL and slime split the same way): every sequence of a packed row is padded to a
multiple of 2 x CP tokens (`packing.pack_thd`'s ``seq_align``; the padding comes after the
sequence's real tokens and has no loss, so causality keeps it from changing anything), cut into
2 x CP chunks of c = L / (2 CP) tokens, and CP rank r holds chunks r and 2 CP - 1 - r, one after
the other, sequence after sequence. A causal sequence's later chunks attend to more keys; pairing
an early chunk with a late one gives every rank the same attention work. Labels, masks,
advantages and log-probs are built per whole sequence before the split, so the last token of a
chunk is labelled by the next chunk's first token, held by another rank.

A split micro-batch keeps the GLOBAL ``cu_seqlens`` / ``max_seqlen`` of the whole row (what
Megatron's ``PackedSeqParams`` means with CP: RoPE takes rank r's two chunks of the global
frequencies, TE's CP attention and `bridge.attention.SDPAttention` read the global layout) and
records ``cp_size``; its tensors hold T / CP tokens.

Legend: T = tokens of the whole packed row; t = T / CP tokens of one rank; c = chunk length.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.utils import SEED_STRIDE


def local_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[t] positions in the whole row [T] of CP rank ``cp_rank``'s tokens, in its local order:
    per sequence, chunk ``cp_rank`` then chunk ``2 cp_size - 1 - cp_rank``."""
    bounds = cu_seqlens.tolist()
    parts: List[torch.Tensor] = []
    for start, end in zip(bounds, bounds[1:]):
        length = end - start
        if length % (2 * cp_size):
            raise ValueError(f"a sequence of {length} tokens does not split into 2 x context_parallel_size "
                             f"{cp_size} chunks: pad it (packing.pack_thd seq_align)")
        c = length // (2 * cp_size)
        parts.append(torch.arange(start + cp_rank * c, start + (cp_rank + 1) * c))
        parts.append(torch.arange(start + (2 * cp_size - 1 - cp_rank) * c, start + (2 * cp_size - cp_rank) * c))
    return torch.cat(parts)


def split_for_context_parallel(batch: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """CP rank ``cp_rank``'s part of a packed micro-batch: every per-token field at
    `local_positions`, the global ``cu_seqlens`` and ``max_seqlen`` kept, ``cp_size`` set.

    Raises:
        ValueError: a padded (not packed) micro-batch, one already split, a sequence whose
            length is not a multiple of 2 x ``cp_size``, or ``cp_rank`` out of range.
    """
    if not batch.is_packed:
        raise ValueError("context parallelism splits packed micro-batches only (packing 'fixed' or 'budget')")
    if batch.cp_size != 1:
        raise ValueError(f"the micro-batch is already split over {batch.cp_size} CP ranks")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for context_parallel_size {cp_size}")
    if cp_size == 1:
        return batch
    idx = local_positions(batch.cu_seqlens.cpu(), cp_size, cp_rank).to(batch.tokens.device)
    fields = {name: getattr(batch, name).index_select(1, idx) for name in batch._tensor_fields()
              if name != "cu_seqlens"}
    # the random-control masks draw per rank from its own chunks (as many tokens as S2T silences
    # there): CP rank r's part is seeded seed + r x SEED_STRIDE, distinct per CP rank
    seed = None if batch.seed is None else batch.seed + cp_rank * SEED_STRIDE
    return dataclasses.replace(batch, cp_size=cp_size, seed=seed, **fields)


def unsplit(pieces: List[torch.Tensor], cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The whole row [B, T] from every CP rank's [B, t] piece (rank order): the inverse of
    `split_for_context_parallel` for one field."""
    cp_size = len(pieces)
    first = pieces[0]
    out = first.new_empty((first.shape[0], first.shape[1] * cp_size) + tuple(first.shape[2:]))
    for rank, piece in enumerate(pieces):
        out[:, local_positions(cu_seqlens.cpu(), cp_size, rank).to(first.device)] = piece
    return out


def gather_row(values: torch.Tensor, cu_seqlens: torch.Tensor, cp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The whole row [B, T] of a per-token field [B, t] split over ``cp_group`` (collective;
    no gradient). For statistics that need whole sequences (the mismatch metrics)."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return values
    pieces = [torch.empty_like(values) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(pieces, values.contiguous(), group=cp_group)
    return unsplit(pieces, cu_seqlens)


def cp_sum(cp_group: Optional[dist.ProcessGroup]) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The ``sequence_sum`` of the per-sequence statistics (``method.objective.SequenceSum``):
    a tensor [N] over a micro-batch's sequences summed over ``cp_group``, whose ranks hold the
    other chunks of the same sequences (None without CP). A collective; no gradient (it adds
    counts and sums of constants: GRPO's |o_i|, the ``seq_mask`` correction's log-ratios)."""
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return None

    def total(values: torch.Tensor) -> torch.Tensor:
        out = values.detach().clone()
        dist.all_reduce(out, group=cp_group)
        return out

    return total


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over a group; backward: the gradients of every rank's use of the
    gathered tensor summed over the group, this rank's slice kept (a reduce-scatter). gloo has
    reduce-scatter as well as NCCL in torch 2.13 (checked), so one path serves both."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, local.contiguous(), group=group)
        return torch.stack(pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = torch.empty_like(grad[0])
        dist.reduce_scatter(out, list(grad.contiguous().unbind(0)), group=ctx.group)
        return out, None


def all_gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[CP, t, ...]: every CP rank's ``local`` [t, ...], differentiable (module `_AllGatherSequence`)."""
    return _AllGatherSequence.apply(local, group)
