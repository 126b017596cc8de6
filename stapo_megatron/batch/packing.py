"""Packed (THD) micro-batches and token-budget micro-batches balanced over data-parallel ranks.

Packing (`pack_thd`): the sequences of a micro-batch are laid end to end in one row of T tokens
with ``cu_seqlens`` marking where each starts, instead of N rows right-padded to the longest.
Every per-token field is built exactly as ``microbatch.pack_sequences`` builds a row (the label at
position t is token t + 1, the response mask, advantages, rollout log-probs), sequence by
sequence, and the RoPE positions restart at 0 in every sequence (Megatron rotates a THD row
per ``cu_seqlens``; ``position_ids`` say the same). The attention keeps each sequence to itself
(`stapo_megatron.bridge.attention` on the local spec, TE's THD kernels on the TE spec), so a
packed sequence sees exactly what it saw alone in its padded row. The only padding is a tail
up to ``align`` tokens (sequence parallelism splits T over TP), a sequence of its own that has
no loss tokens.

Token budget (`plan_token_budget`): whole sequences go into micro-batches of at most
``max_tokens`` tokens, every DP rank gets the same number of micro-batches (Megatron's schedules
and DDP expect it) and near-equal token counts. The peers' names for the same knob: verl
``ppo_max_token_len_per_gpu`` (with ``use_dynamic_bsz``), NeMo-RL
``dynamic_batching.train_mb_tokens`` / ``sequence_packing.train_mb_tokens``, slime
``--max-tokens-per-gpu``. Like them the number of micro-batches is the smallest that fits; the
bins are then filled longest-first into the lightest bin (LPT, a greedy cousin of the
Karmarkar-Karp partition verl and slime use), and the bins are dealt to the ranks the same way.
Ties are broken by a seeded permutation, so a seed fixes the plan.

Context parallelism (``context_parallel_size`` > 1): `batch.minibatches.build_minibatches` pads every sequence to a
multiple of 2 x CP tokens (``pack_thd``'s ``seq_align``: after its real tokens, no loss), plans
the micro-batches with a budget of ``max_tokens`` x CP tokens of whole sequences (the budget is
what one rank holds after the split), and keeps this CP rank's chunks of each packed row
(`stapo_megatron.batch.context_parallel`). The CP ranks of a DP replica plan the same
micro-batches from the same sequences.

How a mini-batch is split never changes its statistics: the kept-token normaliser is summed by
Megatron over all micro-batches and DP ranks, and tau_H is the quantile over all candidates of
all ranks (``method.masks``), DP x CP under context parallelism; ``tests/integration/test_packing_invariance.py``
and ``tests/batch/test_context_parallel.py`` check it.

Legend: T = tokens of a packed row; L_i = length (prompt + response) of sequence i.
"""

from __future__ import annotations

import heapq
import math
from typing import List, Optional, Sequence

import torch

from stapo_megatron.batch.microbatch import MicroBatch
from stapo_megatron.batch.records import NO_ROUTE, SequenceRecord, TokenFields, carries_routes, token_fields


def pack_thd(
    records: Sequence[SequenceRecord],
    pad_id: int,
    align: int = 1,
    device: Optional[torch.device] = None,
    seed: Optional[int] = None,
    seq_align: int = 1,
) -> MicroBatch:
    """One packed `MicroBatch` [1, T] of the records, T = sum L_i rounded up to ``align``.

    Per token the fields are each record's `records.token_fields` (as ``microbatch.pack_sequences``
    lays them in a padded row), the advantage on its n tokens, positions restarting at 0 per
    sequence. ``seq_align`` > 1 (context parallelism: 2 x CP, `alignment.sequence_multiple`)
    pads every sequence to a multiple of it after its real tokens (pad tokens, no loss, positions
    running on); ``align`` must then be a multiple of it. When the records carry routes, the
    row's routes [1, T, L, K] hold `microbatch.NO_ROUTE` at each sequence's last token and padding.
    """
    if align < 1 or seq_align < 1 or align % seq_align:
        raise ValueError(f"align ({align}) and seq_align ({seq_align}) must be >= 1 and seq_align must divide align")
    if not len(records):
        raise ValueError("pack_thd needs at least one sequence")
    with_routes = carries_routes(records)
    parts, lengths = [], []  # per sequence: (tokens, labels, mask, log-probs, advantages, positions, routes)
    for i, rec in enumerate(records):
        f = token_fields(rec, i, with_routes)
        n = rec.length
        pad = -n % seq_align  # context parallelism: whole 2 x CP chunks, the padding after the real tokens
        adv = torch.cat([torch.full((n,), rec.advantage, dtype=torch.float32), torch.zeros(pad, dtype=torch.float32)])
        parts.append(_padded(f, pad_id, pad) + (adv, torch.arange(n + pad)) +
                     ((_pad_routes(f.routes, pad),) if with_routes else ()))
        lengths.append(n + pad)
    tail = -sum(lengths) % align
    if tail:  # the alignment tail: its own sequence, no loss tokens
        nothing = TokenFields(*(torch.zeros(0, dtype=d) for d in (torch.long, torch.long, torch.bool, torch.float32)),
                              routes=None)
        parts.append(_padded(nothing, pad_id, tail) + (torch.zeros(tail, dtype=torch.float32), torch.arange(tail)) +
                     ((_pad_routes(parts[-1][-1][:0], tail),) if with_routes else ()))
        lengths.append(tail)
    tokens, labels, mask, lp, adv, pos, *routes = (torch.cat(column)[None] for column in zip(*parts))
    batch = MicroBatch(
        tokens=tokens, position_ids=pos, labels=labels, response_mask=mask, advantages=adv, rollout_logprob=lp,
        seed=seed,
        cu_seqlens=torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        max_seqlen=max(lengths),
        routes=routes[0] if with_routes else None,
    )
    return batch if device is None else batch.to(device)


def _padded(f: TokenFields, pad_id: int, pad: int):
    """(tokens, labels, mask, log-probs) of a sequence followed by ``pad`` positions without loss."""
    return (torch.cat([f.tokens, torch.full((pad,), pad_id, dtype=torch.long)]),
            torch.cat([f.labels, torch.zeros(pad, dtype=torch.long)]),
            torch.cat([f.response_mask, torch.zeros(pad, dtype=torch.bool)]),
            torch.cat([f.rollout_logprob, torch.zeros(pad, dtype=torch.float32)]))


def _pad_routes(routes_TLK: torch.Tensor, pad: int) -> torch.Tensor:
    """``routes_TLK`` followed by ``pad`` positions of `NO_ROUTE`."""
    return torch.cat([routes_TLK, routes_TLK.new_full((pad, *routes_TLK.shape[1:]), NO_ROUTE)])


def sequence_ids(cu_seqlens: torch.Tensor, cp_size: int = 1) -> torch.Tensor:
    """[T] index of the sequence each token of a packed row belongs to ([T / cp_size] for one
    context-parallel rank's part: each sequence's two chunks are contiguous there)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long() // cp_size
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths)


def _lpt(items: List[int], weights: Sequence[int], num_bins: int, capacity: Optional[List[int]] = None):
    """Longest-processing-time-first: each item (heaviest first, ``items`` order breaks ties)
    into the lightest bin that has room (``capacity[b]`` items at most, when given).
    Returns (bins of item indices, bin loads)."""
    order = sorted(items, key=lambda i: -weights[i])  # stable: the caller's order breaks ties
    bins: List[List[int]] = [[] for _ in range(num_bins)]
    loads = [0] * num_bins
    heap = [(0, b) for b in range(num_bins)]
    for i in order:
        full = []
        load, b = heapq.heappop(heap)
        while capacity is not None and len(bins[b]) >= capacity[b]:
            full.append((load, b))
            load, b = heapq.heappop(heap)
        bins[b].append(i)
        loads[b] += weights[i]
        heapq.heappush(heap, (loads[b], b))
        for entry in full:
            heapq.heappush(heap, entry)
    return bins, loads


def plan_token_budget(lengths: Sequence[int], max_tokens: int, num_ranks: int = 1, seed: int = 0,
                      align: int = 1) -> List[List[List[int]]]:
    """Whole sequences into micro-batches of at most ``max_tokens`` tokens, the same number M
    per DP rank, balanced in tokens over micro-batches and over ranks.

    Args:
        lengths: L_i of every sequence of the mini-batch (all DP ranks').
        max_tokens: the token budget of one packed micro-batch (after rounding to ``align``).
        num_ranks: DP ranks to deal the micro-batches to.
        seed: fixes the tie-breaking permutation (the plan is a function of the lengths and it).
        align: a packed row is rounded up to a multiple of it; the budget must allow for that.

    Returns:
        plan[rank][microbatch] = sequence indices in increasing order.

    Raises:
        ValueError: budget <= 0, a sequence longer than the budget, fewer sequences than ranks.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens_per_microbatch must be > 0, got {max_tokens}")
    if len(lengths) < num_ranks:
        raise ValueError(f"{len(lengths)} sequences cannot give each of {num_ranks} DP ranks a micro-batch")
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if -(-lengths[longest] // align) * align > max_tokens:
        raise ValueError(
            f"sequence {longest} has {lengths[longest]} tokens (prompt + response) > max_tokens_per_microbatch "
            f"{max_tokens}; raise the budget to at least {lengths[longest]} (a sequence is never split)"
        )
    # the caller's order permuted by the seed breaks ties between equal lengths
    ties = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    per_rank = max(1, math.ceil(sum(lengths) / (max_tokens * num_ranks)))
    while True:
        num_bins = per_rank * num_ranks
        bins, loads = _lpt(ties, lengths, num_bins)
        rounded = [-(-load // align) * align for load in loads]
        if max(rounded) <= max_tokens and all(bins):
            break
        if num_bins >= len(lengths):
            raise ValueError(f"{len(lengths)} sequences cannot fill {num_ranks} ranks x {per_rank} micro-batches "
                             f"of at most {max_tokens} tokens")
        per_rank += 1
    # deal the bins to ranks: heaviest first to the lightest rank with fewer than M bins
    by_rank, _ = _lpt(list(range(num_bins)), loads, num_ranks, capacity=[per_rank] * num_ranks)
    return [[sorted(bins[b]) for b in sorted(rank_bins, key=lambda b: min(bins[b]))] for rank_bins in by_rank]


def plan_fixed_count(num_sequences: int, per_microbatch: int, num_ranks: int = 1) -> List[List[List[int]]]:
    """The padded mode's split, packed: rank r gets the r-th contiguous share of the sequences,
    cut into micro-batches of ``per_microbatch`` sequences (each must divide)."""
    if num_sequences % num_ranks or (num_sequences // num_ranks) % per_microbatch:
        raise ValueError(f"{num_sequences} sequences do not split into {num_ranks} ranks x micro-batches "
                         f"of {per_microbatch}")
    share = num_sequences // num_ranks
    return [[list(range(r * share + s, r * share + s + per_microbatch)) for s in range(0, share, per_microbatch)]
            for r in range(num_ranks)]


def imbalance(plan: List[List[List[int]]], lengths: Sequence[int]) -> float:
    """max / mean tokens per DP rank of a plan (1.0 = perfectly balanced)."""
    per_rank = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    return max(per_rank) / (sum(per_rank) / len(per_rank))


