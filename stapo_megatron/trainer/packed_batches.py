"""A step's packed mini-batches (``TrainerConfig.packing`` "fixed" or "budget"; "padded" stays in
``trainer.loop``): every DP rank's sequences are exchanged so that each mini-batch is split over
all ranks at once (`stapo_megatron.train.packing.rank_microbatches`), balancing tokens per rank.

Context parallelism: the CP ranks of one DP replica hold the same sequences (`trainer.layout`
shares the replica's rollouts over CP) and build the same plan; each keeps its chunks of every
packed row (``train.context_parallel``), so the token budget is per rank after the split.

Mixture-of-experts routes (router replay, the routing measurement) do not travel in that
exchange: once the plan is known, each rank receives only the routes of the sequences it trains,
from the rank that sampled them (`_exchange_routes`, one all-to-all per mini-batch), instead of
every rank's (768 bytes a token at 48 layers x top-8).

Which sequences a rank trains does not change the update: the loss's normaliser and tau_H are
mini-batch statistics summed / taken over all DP ranks (``train.loss``).
"""

from __future__ import annotations

from functools import partial
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.train.batching import MicroBatch
from stapo_megatron.train.packing import rank_microbatches


def packed_minibatches(trainer, step: int, prompts: List[List[int]], samples: List[List], adv_PG: torch.Tensor,
                       routes: Optional[List[torch.Tensor]] = None) -> Tuple[List[List[MicroBatch]], int]:
    """This rank's packed micro-batches per PPO mini-batch, and the longest packed row.

    Args:
        trainer: the `Trainer` (its cfg: packing, micro_batch_size, max_tokens_per_microbatch,
            minibatch_prompts, rollout.group_size; groups, seeds, tokenizer, device, and
            seq_multiple, the alignment of a packed row: sequence parallelism splits it over TP;
            seq_align, every sequence's: 2 x CP chunks).
        prompts, samples, adv_PG: this DP rank's prompts, their G samples and advantages [P, G].
        routes: MoE, the flat samples' ``routed_experts`` (sent to the rank that trains each
            sequence, as int16), or None.
    """
    cfg, groups, seeds = trainer.cfg, trainer.groups, trainer.seeds
    pad_id, align, device = trainer.tokenizer.pad_token_id, trainer.seq_multiple, trainer.device
    G = cfg.rollout.group_size
    flat = [s for group in samples for s in group]
    mine = [(prompts[i // G], list(s.token_ids), list(s.logprobs), float(a))
            for i, (s, a) in enumerate(zip(flat, adv_PG.reshape(-1).tolist()))]
    dp_size, dp_rank = dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
    everyone = [None] * dp_size
    dist.all_gather_object(everyone, mine, group=groups.dp)
    per_mini = cfg.minibatch_prompts // dp_size * G
    minis = []
    for m, start in enumerate(range(0, len(mine), per_mini)):
        seqs = [seq for rank_seqs in everyone for seq in rank_seqs[start:start + per_mini]]
        p, r, lp, a = (list(x) for x in zip(*seqs))
        fetch = None if routes is None else partial(
            _exchange_routes, routes[start:start + per_mini], [len(x) + len(y) for x, y in zip(p, r)], per_mini,
            groups.dp, trainer.dp_device)
        minis.append(rank_microbatches(
            p, r, a, lp, pad_id, packing=cfg.packing, micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_microbatch, num_ranks=dp_size, rank=dp_rank,
            seed=seeds.microbatches(step, start, 0), align=align, device=device,
            context_parallel_size=groups.cp_size, cp_rank=dist.get_rank(groups.cp) if groups.cp_size > 1 else 0,
            seq_align=trainer.seq_align, routes=fetch))
    return minis, max(mb.tokens.shape[1] for mini in minis for mb in mini)  # this rank's tokens (after a CP split)


def _exchange_routes(own: List[torch.Tensor], lengths: List[int], per_rank: int, dp_group, device,
                     plan: List[List[List[int]]]) -> List[Optional[torch.Tensor]]:
    """The routes of the mini-batch's sequences this DP rank trains under ``plan``, from the
    ranks that sampled them; None for the others.

    Sequence g of the mini-batch (all ranks' sequences in rank order, ``per_rank`` each) was
    sampled by rank g // per_rank (``own[g % per_rank]`` there) and has ``lengths[g] - 1`` routed
    positions, so every rank knows every size: one ``all_to_all_single`` of the int16 routes as
    bytes (gloo and NCCL move uint8) on the DP group's device.
    """
    rank, size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    needs = [sorted(g for mb in plan[r] for g in mb) for r in range(size)]
    layers_topk = own[0].shape[1:]

    def nbytes(g: int) -> int:  # int16 routes of sequence g's routed positions
        return (lengths[g] - 1) * layers_topk.numel() * 2

    send = [[g for g in needs[r] if g // per_rank == rank] for r in range(size)]  # g ascending per rank
    recv = [[g for g in needs[rank] if g // per_rank == r] for r in range(size)]
    empty = torch.empty(0, dtype=torch.uint8)
    payload = torch.cat([empty] + [own[g % per_rank].to(torch.int16).contiguous().view(torch.uint8).reshape(-1)
                                   for r in range(size) for g in send[r]])
    out = torch.empty(sum(nbytes(g) for part in recv for g in part), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, payload.to(device), [sum(nbytes(g) for g in part) for part in recv],
                           [sum(nbytes(g) for g in part) for part in send], group=dp_group)
    routes: List[Optional[torch.Tensor]] = [None] * len(lengths)
    received = [g for part in recv for g in part]
    for g, chunk in zip(received, out.cpu().split([nbytes(g) for g in received])):
        routes[g] = chunk.view(torch.int16).view(lengths[g] - 1, *layers_topk)
    return routes
