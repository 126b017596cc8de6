"""The pooled modes' schedules, where the engines decide which of a replica's prompts a step
trains, and `build_schedule`, the schedule of a ``rollout.mode``.

"partial" (`PartialSchedule`, `stapo_megatron.serve.partial`): the requests of
`stapo_megatron.trainer.rollout_schedule.SeparateSchedule` go into each replica's pool on its
engine, which returns the first complete groups and keeps the rest, continued next step with newer
weights (a continued response's first tokens are older than the request's policy, bounded by
``rollout.partial.max_token_age``).

"streaming" (`StreamingSchedule`, `stapo_megatron.serve.stream_pools`): step s's prompts are sent
after the weights of step s - k (k = ``rollout.separate.max_staleness``, eta) into the replica's
admission queue; whichever of the replica's engines has room admits the next group (each group
under weights at most eta versions older than the step its place in the queue trains at), the
engines take the weights between two decode iterations and post each group as it completes; step
s takes the first P groups to arrive, or the queue's next P (``rollout.streaming.order``); the
tokens' versions say which policy sampled each. The stream positions a step trained (and with
dynamic sampling, `StreamingSchedule.replace`, those whose groups it dropped) are written to
``rollout_order.jsonl`` (``order_log``), a line per step.

Both keep their account of the prompts in flight (`stapo_megatron.trainer.pool_ledger.PoolLedger`)
in the checkpoint (`PooledSchedule.state_dict`), and a resumed run sends the prompts that were in
flight again.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional

import torch.distributed as dist

from stapo_megatron.batch.step_rollout import StepRollout
from stapo_megatron.rollout.remote import PoolRequest
from stapo_megatron.serve.partial import round_seed
from stapo_megatron.trainer import replicas
from stapo_megatron.trainer.pool_ledger import PoolLedger, partial_metrics
from stapo_megatron.trainer.rollout_schedule import ColocatedSchedule, RolloutSchedule, SeparateSchedule


class PooledSchedule(SeparateSchedule):
    """What the partial and streaming schedules share: the ledger of the stream positions sent to
    this replica's pool and not yet trained, its checkpoint, and the pools' metrics."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # pooled rollouts with CP, or with fewer replicas than engines, are refused when the config
        # is built (`stapo_megatron.config.parallel_layout`)
        assert self.groups.cp_size == 1
        self.ledger = PoolLedger()
        self.positions: List[int] = []
        """The stream positions the last step trained, in its record's order."""
        self.dropped: List[int] = []
        """Dynamic sampling: the stream positions whose groups the last step dropped."""
        self.pool_state: dict = {}
        self.asks = self.groups.mp is None or dist.get_rank(self.groups.mp) == 0
        """This rank sends its replica's prompts (the first of its model-parallel group)."""

    def metrics(self, rollout: StepRollout, device) -> Dict[str, float]:
        """Also the pools' metrics (`stapo_megatron.trainer.pool_ledger.partial_metrics`)."""
        return {**super().metrics(rollout, device),
                **partial_metrics(rollout, self.config, self.pool_state, self.groups, device)}

    def state_dict(self) -> dict:
        """Every training rank's `PoolLedger`, by rank (collective over the training ranks)."""
        ledgers: List[Optional[dict]] = [None] * dist.get_world_size()
        dist.all_gather_object(ledgers, self.ledger.state_dict())
        return {"pool_ledgers": ledgers}

    def load_state_dict(self, trainer_state: dict) -> None:
        ledgers = trainer_state.get("pool_ledgers")
        name = f"rollout.mode={self.config.mode!r}"
        if ledgers is None or len(ledgers) != dist.get_world_size():
            raise ValueError(
                f"{name} resumes from a checkpoint whose trainer state has "
                + ("no pool ledgers (saved in another rollout mode, or before they were checkpointed)"
                   if ledgers is None else f"pool ledgers of {len(ledgers)} training ranks, not {dist.get_world_size()}")
                + f": its in-flight prompts cannot be recovered; resume it in another rollout mode, or start a new run")
        self.ledger.load_state_dict(ledgers[dist.get_rank()])

    def _record(self, step: int, replies: List[dict], version: int) -> StepRollout:
        """The replies' groups (the prompts the pools finished first) as the step's record, its
        version the oldest among their tokens."""
        groups = [g for reply in replies for g in reply["groups"]]
        self.dropped = []
        self.positions = self._trained(replies, groups)
        self.pool_state = {k: sum(reply[k] for reply in replies) for k in ("pool", "waiting", "continued")}
        return StepRollout.of_groups(step, [(g.index, g.prompt) for g in groups], self.answer,
                                     [g.samples for g in groups], self.config.group_size)

    def _trained(self, replies: List[dict], groups: List) -> List[int]:
        raise NotImplementedError

    def _entry(self, position: int):
        """(position, training-set index, prompt ids) of a stream position of this replica's data order."""
        per_step = len(self.prompts(0))
        return (position, *self.prompts(position // per_step)[position % per_step])


class PartialSchedule(PooledSchedule):
    """``rollout.mode="partial"``: each step's prompts (and the over-sampling's) into the pool."""

    def _request(self, step: int, settings) -> object:
        p = self.config.partial
        fresh, following = self.prompts(step), self.prompts(step + 1)
        per_step = len(fresh)
        extra = math.ceil((p.oversample - 1) * per_step)  # the next step's first prompts: the over-sampling
        order = [(step * per_step + j, i, ids) for j, (i, ids) in enumerate(fresh + following[:extra])]
        window = self.ledger.window(order, self._entry)  # what the pool has not had, in-flight first on resume
        return self.engine.submit_partial(window if self.asks else [], settings,
                                          PoolRequest(per_step, per_step + extra, self.config.round_tokens))

    def _trained(self, replies: List[dict], groups: List) -> List[int]:
        return self.ledger.trained([g.index for g in groups])


class StreamingSchedule(PooledSchedule):
    """``rollout.mode="streaming"``: each step's prompts join the replica's admission queue."""

    def metrics(self, rollout: StepRollout, device) -> Dict[str, float]:
        """Also logs the step's stream positions (`order_log`)."""
        row = super().metrics(rollout, device)
        self._log_order(rollout.step)
        return row

    def replace(self, step: int, slots: List[int], round_index: int) -> Optional[StepRollout]:
        """Dynamic sampling: groups to replace the step's groups at ``slots`` (their places in the
        step's record), of the next replacement prompts (`PoolLedger.send_extra`), asked ahead of
        the queued steps and seeded from the step's seed and ``round_index``; None when ``slots``
        is empty. The replaced groups' positions are logged as dropped. Collective over the
        training ranks (every rank calls it, with its own slots)."""
        count = len(slots)
        entries = self.ledger.send_extra(count, self._entry)
        settings = self.config.settings(round_seed(self.seed(step), round_index))
        ticket = self.engine.submit_stream(entries if self.asks else [], settings,
                                           PoolRequest(count, count, 0, urgent=True))
        replies = replicas.replica_receive(self.engine, self.groups, ticket, self.timeout_s)
        groups = [g for reply in replies for g in reply["groups"]]
        positions = [p for reply in replies for p in reply["positions"]]
        self.ledger.trained_positions(positions)
        for slot, position in zip(slots, positions):
            self.dropped.append(self.positions[slot])
            self.positions[slot] = position
        if not groups:
            return None
        return StepRollout.of_groups(step, [(g.index, g.prompt) for g in groups], self.answer,
                                     [g.samples for g in groups], self.config.group_size)

    def _request(self, step: int, settings) -> object:
        fresh = self.prompts(step)
        order = [(step * len(fresh) + j, i, ids) for j, (i, ids) in enumerate(fresh)]
        window = self.ledger.window(order, self._entry)  # in-flight positions first on resume
        return self.engine.submit_stream(window if self.asks else [], settings,
                                         PoolRequest(len(fresh), len(fresh), 0, order=self.config.streaming.order))

    def _trained(self, replies: List[dict], groups: List) -> List[int]:
        positions = [p for reply in replies for p in reply["positions"]]  # whatever order the groups completed in
        self.ledger.trained_positions(positions)
        return positions

    def _log_order(self, step: int) -> None:
        """Rank 0 appends the stream positions each DP replica trained at ``step`` (collective over
        the training ranks)."""
        dp_rank = 0 if self.groups.dp is None else dist.get_rank(self.groups.dp)
        gathered: List[Optional[tuple]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dp_rank, (self.positions, self.dropped)))
        if dist.get_rank() == 0 and self.order_log is not None:
            by_replica = sorted(dict(gathered).items())
            line = {"step": step, "positions": {str(rank): trained for rank, (trained, _) in by_replica}}
            if self.config.streaming.filter_groups:
                line["dropped"] = {str(rank): dropped for rank, (_, dropped) in by_replica}
            with open(self.order_log, "a") as log:
                log.write(json.dumps(line) + "\n")


SCHEDULES = {"colocated": ColocatedSchedule, "separate": SeparateSchedule, "partial": PartialSchedule,
             "streaming": StreamingSchedule}
"""``rollout.mode`` -> its schedule's class."""


def build_schedule(config, *args, **kwargs) -> RolloutSchedule:
    """The schedule of ``config.mode`` (`RolloutSchedule`'s arguments)."""
    return SCHEDULES[config.mode](config, *args, **kwargs)
