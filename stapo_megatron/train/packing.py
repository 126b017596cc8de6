"""Packed (THD) micro-batches and token-budget micro-batches balanced over data-parallel ranks.

Packing (`pack_thd`): the sequences of a micro-batch are laid end to end in one row of T tokens
with ``cu_seqlens`` marking where each starts, instead of N rows right-padded to the longest.
Every per-token field is built exactly as ``batching.pack_sequences`` builds a row (the label at
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

Context parallelism (``context_parallel_size`` > 1): `rank_microbatches` pads every sequence to a
multiple of 2 x CP tokens (``pack_thd``'s ``seq_align``: after its real tokens, no loss), plans
the micro-batches with a budget of ``max_tokens`` x CP tokens of whole sequences (the budget is
what one rank holds after the split), and keeps this CP rank's chunks of each packed row
(`stapo_megatron.train.context_parallel`). The CP ranks of a DP replica plan the same
micro-batches from the same sequences.

How a mini-batch is split never changes its statistics: the kept-token normaliser is summed by
Megatron over all micro-batches and DP ranks, and tau_H is the quantile over all candidates of
all ranks (``method.masks``), DP x CP under context parallelism; ``tests/test_packing_invariance.py``
and ``tests/test_context_parallel.py`` check it.

Legend: T = tokens of a packed row; L_i = length (prompt + response) of sequence i.
"""

from __future__ import annotations

import heapq
import math
from typing import Callable, List, Optional, Sequence, Union

import torch

from stapo_megatron.config.layout import PACKING_MODES
from stapo_megatron.train.batching import NO_ROUTE, MicroBatch, pack_sequences, sequence_routes
from stapo_megatron.train.context_parallel import split_for_context_parallel


def pack_thd(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    advantages: Sequence[float],
    rollout_logprobs: Sequence[Sequence[float]],
    pad_id: int,
    align: int = 1,
    device: Optional[torch.device] = None,
    seed: Optional[int] = None,
    seq_align: int = 1,
    routes: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> MicroBatch:
    """One packed `MicroBatch` [1, T] of the (prompt, response) pairs, T = sum L_i rounded up to
    ``align``.

    Per token the fields equal those of ``batching.pack_sequences`` on each pair alone (its
    first L_i positions), positions restart at 0 per sequence. ``seq_align`` > 1 (context
    parallelism: 2 x CP, `context_parallel.sequence_multiple`) pads every sequence to a
    multiple of it after its real tokens (pad tokens, no loss, positions running on); ``align``
    must then be a multiple of it. ``routes`` (each pair's ``Sample.routed_experts``): the
    row's routes [1, T, L, K], `batching.NO_ROUTE` at each sequence's last token and padding.
    """
    if align < 1 or seq_align < 1 or align % seq_align:
        raise ValueError(f"align ({align}) and seq_align ({seq_align}) must be >= 1 and seq_align must divide align")
    if not len(prompts):
        raise ValueError("pack_thd needs at least one sequence")
    tokens, labels, mask, lp, adv, pos, lengths, route_parts = [], [], [], [], [], [], [], []
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        if len(rollout_logprobs[i]) != len(response):
            raise ValueError(
                f"sequence {i}: {len(rollout_logprobs[i])} rollout log-probs for {len(response)} response tokens"
            )
        seq = list(prompt) + list(response)
        n, start = len(seq), len(prompt) - 1
        tokens += seq
        labels += seq[1:] + [0]
        mask += [False] * start + [True] * len(response) + [False]
        lp += [0.0] * start + [float(x) for x in rollout_logprobs[i]] + [0.0]
        adv += [float(advantages[i])] * n
        pad = -n % seq_align  # context parallelism: whole 2 x CP chunks, the padding after the real tokens
        if routes is not None:
            route_parts.append(_pad_routes(sequence_routes(routes[i], i, n), pad))
        tokens += [pad_id] * pad
        labels += [0] * pad
        mask += [False] * pad
        lp += [0.0] * pad
        adv += [0.0] * pad
        pos += range(n + pad)
        lengths.append(n + pad)
    tail = -len(tokens) % align
    if tail:  # the alignment tail: its own sequence, no loss tokens
        tokens += [pad_id] * tail
        labels += [0] * tail
        mask += [False] * tail
        lp += [0.0] * tail
        adv += [0.0] * tail
        pos += range(tail)
        lengths.append(tail)
        if routes is not None:
            route_parts.append(_pad_routes(route_parts[-1][:0], tail))
    row = lambda values, dtype: torch.tensor(values, dtype=dtype)[None]  # noqa: E731
    batch = MicroBatch(
        tokens=row(tokens, torch.long),
        position_ids=row(pos, torch.long),
        labels=row(labels, torch.long),
        response_mask=row(mask, torch.bool),
        advantages=row(adv, torch.float32),
        rollout_logprob=row(lp, torch.float32),
        seed=seed,
        cu_seqlens=torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        max_seqlen=max(lengths),
        routes=torch.cat(route_parts)[None] if routes is not None else None,
    )
    return batch if device is None else batch.to(device)


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


def rank_microbatches(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    advantages: Sequence[float],
    rollout_logprobs: Sequence[Sequence[float]],
    pad_id: int,
    *,
    packing: str,
    micro_batch_size: int = 1,
    max_tokens: int = 0,
    num_ranks: int = 1,
    rank: int = 0,
    seed: int = 0,
    align: int = 1,
    seq_length: Optional[int] = None,
    device: Optional[torch.device] = None,
    context_parallel_size: int = 1,
    cp_rank: int = 0,
    seq_align: int = 1,
    routes: Union[None, Sequence[Optional[torch.Tensor]], Callable[[List[List[List[int]]]], Sequence]] = None,
) -> List[MicroBatch]:
    """This DP rank's micro-batches of one mini-batch given as all ranks' sequences.

    "padded" and "fixed": rank r takes the r-th contiguous share, cut into micro-batches of
    ``micro_batch_size`` sequences ("padded" right-pads them to ``seq_length``); "budget": the
    `plan_token_budget` plan (``max_tokens``, ``seed``). The micro-batch with first sequence i
    gets seed ``seed + i`` (the random-control masks).

    Context parallelism (``context_parallel_size`` > 1, packed modes only): every sequence is
    padded to a multiple of ``seq_align`` (`context_parallel.sequence_multiple`) and each packed
    row is split, CP rank ``cp_rank`` keeping its part (`context_parallel.split_for_context_parallel`).
    ``max_tokens`` then counts the tokens one rank holds after the split: the plan packs up to
    ``max_tokens x context_parallel_size`` tokens of whole (padded) sequences per micro-batch,
    so a sequence longer than ``max_tokens`` trains.

    ``routes``: each sequence's ``Sample.routed_experts`` (MoE), carried as ``MicroBatch.routes``;
    or a function of the plan (plan[rank][microbatch] = sequence indices) returning that list,
    where only this rank's sequences need routes (the trainer fetches just those from the DP
    ranks that sampled them: `stapo_megatron.trainer.packed_batches`).
    """
    if packing not in PACKING_MODES:
        raise ValueError(f"packing must be one of {PACKING_MODES}, got {packing!r}")
    if context_parallel_size > 1 and packing == "padded":
        raise ValueError(f"context_parallel_size {context_parallel_size} needs packed micro-batches "
                         f"(packing 'fixed' or 'budget'), got packing='padded'")
    align = math.lcm(align, seq_align)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    if packing == "budget":
        padded = [-(-n // seq_align) * seq_align for n in lengths]
        cp_budget = max_tokens * context_parallel_size
        if context_parallel_size > 1 and max(padded) > cp_budget:
            raise ValueError(f"a sequence of {max(lengths)} tokens (padded to {max(padded)}) > max_tokens_per_microbatch "
                             f"{max_tokens} x context_parallel_size {context_parallel_size} = {cp_budget}")
        plan = plan_token_budget(padded, cp_budget, num_ranks, seed, align)
    else:
        plan = plan_fixed_count(len(lengths), micro_batch_size, num_ranks)
    if callable(routes):
        routes = routes(plan)
    pick = lambda xs, idx: [xs[i] for i in idx]  # noqa: E731
    out = []
    for idx in plan[rank]:
        args = (pick(prompts, idx), pick(responses, idx), pick(advantages, idx), pick(rollout_logprobs, idx), pad_id)
        mine = None if routes is None else pick(routes, idx)
        if packing == "padded":
            mb = pack_sequences(*args, seq_length=seq_length or -(-max(lengths) // align) * align, device=device,
                                routes=mine)
            mb.seed = seed + idx[0]
        else:
            mb = pack_thd(*args, align=align, device=device, seed=seed + idx[0], seq_align=seq_align, routes=mine)
            mb = split_for_context_parallel(mb, context_parallel_size, cp_rank)
        out.append(mb)
    return out
