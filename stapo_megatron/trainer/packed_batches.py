"""A step's packed mini-batches (``TrainerConfig.packing`` "fixed" or "budget"; "padded" stays in
``trainer.loop``): every DP rank's sequences are exchanged so that each mini-batch is split over
all ranks at once (`stapo_megatron.train.packing.rank_microbatches`), balancing tokens per rank.

Context parallelism: the CP ranks of one DP replica hold the same sequences (`trainer.layout`
shares the replica's rollouts over CP) and build the same plan; each keeps its chunks of every
packed row (``train.context_parallel``), so the token budget is per rank after the split.

Which sequences a rank trains does not change the update: the loss's normaliser and tau_H are
mini-batch statistics summed / taken over all DP ranks (``train.loss``).
"""

from __future__ import annotations

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
        routes: MoE, the flat samples' ``routed_experts`` (travel with their sequences, as int16),
            or None.
    """
    cfg, groups, seeds = trainer.cfg, trainer.groups, trainer.seeds
    pad_id, align, device = trainer.tokenizer.pad_token_id, trainer.seq_multiple, trainer.device
    G = cfg.rollout.group_size
    flat = [s for group in samples for s in group]
    mine = [(prompts[i // G], list(s.token_ids), list(s.logprobs), float(a),
             None if routes is None else routes[i].to(torch.int16))
            for i, (s, a) in enumerate(zip(flat, adv_PG.reshape(-1).tolist()))]
    dp_size, dp_rank = dist.get_world_size(groups.dp), dist.get_rank(groups.dp)
    everyone = [None] * dp_size
    dist.all_gather_object(everyone, mine, group=groups.dp)
    per_mini = cfg.minibatch_prompts // dp_size * G
    minis = []
    for m, start in enumerate(range(0, len(mine), per_mini)):
        seqs = [seq for rank_seqs in everyone for seq in rank_seqs[start:start + per_mini]]
        p, r, lp, a, rt = (list(x) for x in zip(*seqs))
        minis.append(rank_microbatches(
            p, r, a, lp, pad_id, packing=cfg.packing, micro_batch_size=cfg.micro_batch_size,
            max_tokens=cfg.max_tokens_per_microbatch, num_ranks=dp_size, rank=dp_rank,
            seed=seeds.microbatches(step, start, 0), align=align, device=device,
            context_parallel_size=groups.cp_size, cp_rank=dist.get_rank(groups.cp) if groups.cp_size > 1 else 0,
            seq_align=trainer.seq_align, routes=None if routes is None else rt))
    return minis, max(mb.tokens.shape[1] for mini in minis for mb in mini)  # this rank's tokens (after a CP split)
