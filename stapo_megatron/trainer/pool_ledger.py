"""The trainers' account of their replica's prompts on the engines (partial and streaming
rollouts): `PoolLedger`, which stream positions were sent and which of them trained, held in the
checkpoint, so that a resumed run sends the positions that were in flight again (their groups
start over with the resumed policy) and never sends one that trained: every data position trains
once across a kill and a resume. And the step's partial-rollout metrics (`partial_metrics`).
The pools themselves run on the engine ranks (`stapo_megatron.serve.partial`,
`stapo_megatron.serve.stream_pools`).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

from stapo_megatron.batch.step_rollout import StepRollout

Entry = Tuple[int, int, List[int]]
"""(stream position, training-set index, prompt ids): one prompt of a replica's data order."""
EXTRA_POSITIONS = 2**40
"""Dynamic sampling's replacement prompts (streaming rollouts) take the stream positions from
here on: the replica's data order far past any run's steps, so they never repeat a step's own
prompts (`PoolLedger.send_extra`)."""


class PoolLedger:
    """The trainers' account of their replica's `PartialPool` (module docstring): which stream
    positions were sent and which of them trained; checkpointed, so a resume loses none and
    repeats none."""

    def __init__(self):
        self.sent_upto = 0
        """The first stream position never sent (the pool's ``next_position``)."""
        self.in_flight: Dict[int, int] = {}
        """Stream position -> training-set index of the prompts sent and not yet trained, in order."""
        self.resend: List[int] = []
        """After a resume: the positions in flight at the checkpoint, sent again first."""
        self.extra_upto = EXTRA_POSITIONS
        """Dynamic sampling: the first replacement position never sent."""

    def window(self, entries: Sequence[Entry], entry: Callable[[int], Entry]) -> List[Entry]:
        """What to send of ``entries`` (a window of the data order, ascending): after a resume
        the positions that were in flight first (``entry(position)`` builds them), then those never
        sent; the positions sent before and trained since are left out."""
        out = [entry(p) for p in self.resend] + [e for e in entries if e[0] >= self.sent_upto]
        self.resend = []
        for position, index, _ in out:
            self.in_flight[position] = index
            if position < EXTRA_POSITIONS:  # a resent replacement is not the steps' stream
                self.sent_upto = max(self.sent_upto, position + 1)
        return out

    def send_extra(self, count: int, entry: Callable[[int], Entry]) -> List[Entry]:
        """Dynamic sampling: the next ``count`` replacement prompts (``entry(position)`` builds
        them), now in flight."""
        out = [entry(p) for p in range(self.extra_upto, self.extra_upto + count)]
        self.extra_upto += count
        for position, index, _ in out:
            self.in_flight[position] = index
        return out

    def trained(self, indices: Sequence[int]) -> List[int]:
        """The pool returned groups of these training-set indices: their positions (the earliest
        in flight of each index, as the pool admits in order) leave the account; returned."""
        positions = []
        for index in indices:
            position = next((p for p, i in self.in_flight.items() if i == index), None)
            assert position is not None, f"the pool returned training-set index {index}, which was not in flight"
            del self.in_flight[position]
            positions.append(position)
        return positions

    def trained_positions(self, positions: Sequence[int]) -> None:
        """The engine returned the groups of these stream positions (streaming rollouts name
        them): they leave the account."""
        for position in positions:
            assert position in self.in_flight, f"the engine returned stream position {position}, which was not in flight"
            del self.in_flight[position]

    def state_dict(self) -> dict:
        return {"sent_upto": self.sent_upto, "in_flight": sorted(self.in_flight.items()), "extra_upto": self.extra_upto}

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's account; its positions in flight go into the next `window` first."""
        self.sent_upto = state["sent_upto"]
        self.extra_upto = state.get("extra_upto", EXTRA_POSITIONS)
        self.in_flight = dict(state["in_flight"])
        self.resend = sorted(self.in_flight)


def partial_metrics(rollout: StepRollout, config, pool_state: dict, groups, device) -> dict:
    """The step's partial-rollout metrics, over DP: tokens sampled by a policy older than the
    request-level bound (``stale_tokens``, their fraction), the tokens' mean and largest age in
    steps (``token_age_mean``, ``token_age_max``), tokens left out of the loss by the token-level
    bound (``token_age_masked``, `RolloutSampling.token_age_bound`), responses that more than one
    policy sampled; and rank 0's replica's pool (groups in flight, prompts waiting). ``config``:
    the run's `RolloutSampling`."""
    import torch
    import torch.distributed as dist

    step, versions = rollout.step, rollout.token_versions
    bound = config.token_age_bound
    sums = torch.tensor([sum(v < step - config.separate.max_staleness for v in versions), len(versions),
                         sum(step - v for v in versions), sum(len(set(s.versions)) > 1 for s in rollout.samples),
                         0 if bound is None else sum(step - v > bound for v in versions)],
                        dtype=torch.float64, device=device)
    oldest = torch.tensor([max((step - v for v in versions), default=0)], dtype=torch.float64, device=device)
    if groups.dp is not None and dist.get_world_size(groups.dp) > 1:
        dist.all_reduce(sums, group=groups.dp)
        dist.all_reduce(oldest, op=dist.ReduceOp.MAX, group=groups.dp)
    stale, total, age, resumed, masked = sums.tolist()
    return dict(stale_tokens=stale, stale_token_fraction=stale / max(total, 1.0), token_age_mean=age / max(total, 1.0),
                token_age_max=oldest.item(), token_age_masked=masked, resumed_responses=resumed,
                pool_groups=float(pool_state.get("pool", 0)), pool_waiting=float(pool_state.get("waiting", 0)))
