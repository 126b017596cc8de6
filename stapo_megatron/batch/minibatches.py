"""One builder from a step's sequence records to each PPO mini-batch's micro-batches, for every
layout (``TrainerConfig.packing``): `build_minibatches` with a `MicroBatchLayout`.

- "padded": this DP rank's records, right-padded to the longest of them (rounded up to
  ``seq_multiple``) in [N, S] rows, mini-batches of ``minibatch_size`` records cut into
  micro-batches of ``micro_batch_size`` rows.
- "fixed": the same micro-batches packed (THD, `packing.pack_thd`). A mini-batch is every DP
  rank's ``minibatch_size`` records in rank order, and `packing.plan_fixed_count` gives rank r
  the r-th contiguous share: its own records, so nothing moves between ranks.
- "budget": whole records packed to a token budget, balanced over DP (`packing.plan_token_budget`).
  Every rank plans every mini-batch from all ranks' lengths (one all-gather of two integers a
  record), then each rank receives exactly the records it trains from the ranks that sampled
  them, as bytes (`records.encode`: tokens, log-probs, advantage, version, MoE routes) in one
  ``all_to_all_single`` on the DP group's device for the whole step.

Which records a rank trains does not change the update: the loss's normaliser and tau_H are
mini-batch statistics summed / taken over all DP ranks (``mcore.loss``).

Context parallelism (packed layouts): the CP ranks of one DP replica hold the same records
(`trainer.replicas` shares the replica's rollouts over CP) and build the same plan; each keeps its
chunks of every packed row (``batch.context_parallel``), so the token budget is per rank after
the split (the plan packs ``max_tokens x cp_size`` tokens of whole sequences).

Seeds of the random-control masks: ``microbatch_seed(first, dp_rank)`` is the first seed of the
mini-batch that starts at this rank's record ``first`` (the trainer passes
``Seeds.microbatches`` of the step). A padded micro-batch adds its first row, a packed one its
first record's index in the mini-batch (all ranks' records in rank order), with dp_rank 0: all
ranks plan the same mini-batch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from stapo_megatron.batch import records as rec
from stapo_megatron.batch.alignment import PACKING_MODES
from stapo_megatron.batch.microbatch import MicroBatch, pack_sequences, split_microbatches
from stapo_megatron.batch.context_parallel import split_for_context_parallel
from stapo_megatron.batch.packing import pack_thd, plan_fixed_count, plan_token_budget
from stapo_megatron.utils import collective_device
from stapo_megatron.batch.records import SequenceRecord


@dataclasses.dataclass(frozen=True)
class MicroBatchLayout:
    """How a mini-batch's records become micro-batches on this rank."""

    packing: str
    """One of `alignment.PACKING_MODES`: "padded", "fixed" or "budget" (module docstring)."""
    micro_batch_size: int = 1
    """Records per micro-batch ("padded", "fixed")."""
    max_tokens: int = 0
    """"budget": tokens of one packed micro-batch on one rank (after a CP split)."""
    pad_id: int = 0
    """Token id of the padding."""
    seq_multiple: int = 1
    """A row's length (padded S, packed T) is a multiple of it: sequence parallelism splits it over TP."""
    seq_align: int = 1
    """Packed: every sequence is padded to a multiple of it (context parallelism: 2 x CP)."""
    cp_size: int = 1
    """Context-parallel ranks a packed row is split over."""
    cp_rank: int = 0
    """This rank's place in its CP group."""
    device: Optional[torch.device] = None
    """Where the micro-batches live (the model's device; None: the CPU)."""

    def __post_init__(self):
        if self.packing not in PACKING_MODES:
            raise ValueError(f"packing must be one of {PACKING_MODES}, got {self.packing!r}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.cp_size > 1 and self.packing == "padded":
            raise ValueError(f"context_parallel_size {self.cp_size} needs packed micro-batches "
                             f"(packing 'fixed' or 'budget'), got packing='padded'")

    @property
    def align(self) -> int:
        """A packed row's length multiple: both the row's and every sequence's."""
        return math.lcm(self.seq_multiple, self.seq_align)


def _first_record(first: int, dp_rank: int) -> int:
    return 0


def build_minibatches(records: Sequence[SequenceRecord], layout: MicroBatchLayout, minibatch_size: Optional[int] = None,
                      microbatch_seed: Callable[[int, int], int] = _first_record,
                      dp_group=None) -> Tuple[List[List[MicroBatch]], int]:
    """This DP rank's micro-batches of each mini-batch, and the longest row (padded S, packed T).

    Args:
        records: this DP rank's records of the step, mini-batch after mini-batch (every DP rank
            holds as many).
        layout: the `MicroBatchLayout`.
        minibatch_size: records of this rank per mini-batch (None: all in one mini-batch).
        microbatch_seed: the first mask seed of the mini-batch at this rank's record ``first``
            (module docstring; default 0).
        dp_group: the data-parallel group; None: a single DP rank.
    """
    per_mini = minibatch_size or len(records)
    if not records or len(records) % per_mini:
        raise ValueError(f"{len(records)} records do not split into mini-batches of {per_mini}")
    dp_size, dp_rank = (1, 0) if dp_group is None else (dist.get_world_size(dp_group), dist.get_rank(dp_group))
    starts = range(0, len(records), per_mini)
    if layout.packing == "padded":
        seq = -(-max(r.length for r in records) // layout.seq_multiple) * layout.seq_multiple
        batch = pack_sequences(records, layout.pad_id, seq, device=layout.device)
        return [split_microbatches(batch.rows(s, s + per_mini), layout.micro_batch_size,
                                   seed=microbatch_seed(s, dp_rank)) for s in starts], seq
    if layout.packing == "fixed":
        # this rank's share of the mini-batch is its own records (module docstring)
        own = plan_fixed_count(per_mini * dp_size, layout.micro_batch_size, dp_size)[dp_rank]
        minis = [pack_planned(lambda g, s=s: records[s + g - dp_rank * per_mini], own, layout, microbatch_seed(s, 0))
                 for s in starts]
    else:
        minis = _budget_minibatches(records, layout, per_mini, microbatch_seed, dp_group, dp_size, dp_rank)
    return minis, max(mb.tokens.shape[1] for mini in minis for mb in mini)  # this rank's tokens (after a CP split)


def pack_planned(record_of: Callable[[int], SequenceRecord], plan: List[List[int]], layout: MicroBatchLayout,
                 seed: int) -> List[MicroBatch]:
    """The packed micro-batches of one rank's ``plan`` (lists of record indices in the
    mini-batch; ``record_of(index)`` gives the record), each with seed ``seed`` + its first
    index, split over CP."""
    return [split_for_context_parallel(
        pack_thd([record_of(g) for g in idx], layout.pad_id, align=layout.align, device=layout.device,
                 seed=seed + idx[0], seq_align=layout.seq_align), layout.cp_size, layout.cp_rank)
        for idx in plan]


def plan_budget(lengths: Sequence[int], layout: MicroBatchLayout, num_ranks: int, seed: int) -> List[List[List[int]]]:
    """`packing.plan_token_budget` of a mini-batch's record lengths under ``layout``: every
    sequence padded to ``seq_align``, ``max_tokens x cp_size`` tokens of them per micro-batch."""
    padded = [-(-n // layout.seq_align) * layout.seq_align for n in lengths]
    cp_budget = layout.max_tokens * layout.cp_size
    if layout.cp_size > 1 and max(padded) > cp_budget:
        raise ValueError(f"a sequence of {max(lengths)} tokens (padded to {max(padded)}) > max_tokens_per_microbatch "
                         f"{layout.max_tokens} x context_parallel_size {layout.cp_size} = {cp_budget}")
    return plan_token_budget(padded, cp_budget, num_ranks, seed, layout.align)


def _budget_minibatches(records, layout, per_mini, microbatch_seed, dp_group, dp_size, dp_rank):
    """"budget": plan every mini-batch over all ranks' lengths, fetch the records this rank
    trains, pack them. A record is named ``owner * len(records) + index`` (its DP rank, its
    place there); record g of mini-batch start s is ``(g // per_mini, s + g % per_mini)``."""
    num_own = len(records)
    sizes_RN2 = _all_sizes(records, dp_group, dp_size)
    global_id = lambda s, g: (g // per_mini) * num_own + s + g % per_mini  # noqa: E731
    plans = {}
    for s in range(0, num_own, per_mini):
        lengths = [int(sizes_RN2[r, s + i].sum()) for r in range(dp_size) for i in range(per_mini)]
        plans[s] = plan_budget(lengths, layout, dp_size, microbatch_seed(s, 0))
    needs = [sorted({global_id(s, g) for s, plan in plans.items() for mb in plan[r] for g in mb})
             for r in range(dp_size)]
    got = exchange_records(records, needs, sizes_RN2, dp_group, dp_rank) if dp_group is not None else \
        dict(enumerate(records))
    return [pack_planned(lambda g, s=s: got[global_id(s, g)], plan[dp_rank], layout, microbatch_seed(s, 0))
            for s, plan in plans.items()]


def _all_sizes(records: Sequence[SequenceRecord], dp_group, dp_size: int) -> torch.Tensor:
    """[dp_size, records per rank, 2] (prompt, response) lengths of every rank's records."""
    own = torch.tensor([[len(r.prompt_ids), len(r.response_ids)] for r in records], dtype=torch.long)
    if dp_group is None:
        return own[None]
    device = collective_device(dp_group)
    parts = [torch.empty_like(own, device=device) for _ in range(dp_size)]
    dist.all_gather(parts, own.to(device), group=dp_group)
    return torch.stack(parts).cpu()


def exchange_records(records: Sequence[SequenceRecord], needs: List[List[int]], sizes_RN2: torch.Tensor,
                     dp_group, dp_rank: int) -> Dict[int, SequenceRecord]:
    """The records this rank trains, by name (``owner * len(records) + index``), from the ranks
    that hold them: ``needs[r]`` names rank r's, ascending. Every rank knows every record's size
    (``sizes_RN2``), so one ``all_to_all_single`` of bytes (gloo and NCCL move uint8) suffices."""
    num_own, size = len(records), len(needs)
    with_routes = rec.carries_routes(records)
    missing = [i for i, r in enumerate(records) if with_routes and r.routes is None]
    if missing:
        raise ValueError(f"record {missing[0]} has no routes while others carry them (Sample.routed_experts is None)")
    route_shape = tuple(records[0].routes.shape[1:]) if with_routes else None
    nbytes = lambda g: rec.encoded_size(*sizes_RN2[g // num_own, g % num_own].tolist(), route_shape)  # noqa: E731
    send = [[g for g in needs[r] if g // num_own == dp_rank] for r in range(size)]  # ascending per rank
    recv = [[g for g in needs[dp_rank] if g // num_own == r] for r in range(size)]
    device = collective_device(dp_group)
    payload = torch.cat([torch.empty(0, dtype=torch.uint8)] +
                        [rec.encode(records[g % num_own], with_routes) for part in send for g in part])
    out = torch.empty(sum(nbytes(g) for part in recv for g in part), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, payload.to(device), [sum(nbytes(g) for g in part) for part in recv],
                           [sum(nbytes(g) for g in part) for part in send], group=dp_group)
    received = [g for part in recv for g in part]
    return {g: rec.decode(chunk, *sizes_RN2[g // num_own, g % num_own].tolist(), route_shape)
            for g, chunk in zip(received, out.cpu().split([nbytes(g) for g in received]))}
