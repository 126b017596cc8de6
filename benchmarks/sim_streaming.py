"""Streaming rollouts over the cost model of `sim_model.py`: engines that never drain, admission
bounded by an off-policyness eta, the trainer taking complete groups, in-flight weight updates.

- **Admission.** Prompts are admitted in order, each as a group of its G samples, to the engine
  that asks first: an engine asks whenever its KV cache has room for the group's prompts and
  every running sequence's next token, fewer than ``max_num_seqs`` sequences run, and its
  running sequences and the group's fit the cache at a reservation of ``kv_reserve`` x the mean
  sequence each (as SGLang reserves room for the tokens a running request will still generate).
  Group j (0-based, in admission order) may start only under a policy version v with
  j < (v + eta + 1) x P (P prompts a step): AReaL's ``max_head_offpolicyness``, so the version a
  group starts under is at least the version that trains it less eta when groups train in
  admission order.
- **Training.** A step trains P complete groups as soon as they are complete and the trainer is
  free (after sending the previous weights): ``order="completion"`` takes the first P to finish
  (the order is timing's; a slow group can wait longer than eta steps), ``order="admission"``
  the next P in admission order (the data order is the admission order and the request-level
  bound is exact, at the cost of waiting for the slowest group of each step).
- **Weights.** After each update the trainers send the weights (``switch_s``). With
  ``in_flight`` an engine pauses for the load between two decode iterations and keeps its KV
  cache; ``recompute_kv`` adds the prefill of every running sequence's context after the load
  (the cache then matches the new weights). Without ``in_flight`` an engine starts nothing new
  once newer weights wait, finishes its running sequences under the old ones, then loads.
- **KV cache.** Unlike `sim_schedules.Engine` (no preemption: a running sequence keeps growing),
  an engine here admits up to its capacity and, when the running sequences' next tokens do not
  fit, preempts the most recently started one (vLLM's recompute preemption): it waits first in
  line and pays the prefill of its whole context when it starts again.

Every token keeps the version that produced it: ``token_age`` counts trained tokens by (version
trained - version that generated the token), ``staleness`` trained groups by (version trained -
version their group was admitted under).
"""

from __future__ import annotations

import bisect
import collections
import heapq
import math
from typing import Callable, Deque, Dict, List, Optional, Tuple

from sim_model import Prompt, sample_tokens, switch_s
from sim_schedules import Job, _run

ORDERS = ("completion", "admission")


class _Seq:
    __slots__ = ("group", "context", "left", "start_it", "tie", "tokens")

    def __init__(self, group: int, context: int, left: int):
        self.group, self.context, self.left, self.start_it, self.tie = group, context, left, 0, 0
        self.tokens: Dict[int, int] = {}  # version -> tokens it generated


class StreamEngine:
    """One vLLM engine decoding continuously; ``pull(engine)`` returns the next group's
    sequences [(group, prompt_len, response_len)] when admission allows it, else None.
    ``recomputed_tokens``: context tokens prefilled again (after a preemption or a load with
    ``recompute_kv``)."""

    def __init__(self, model, pull: Callable[["StreamEngine"], Optional[list]]):
        self.model, self.pull = model, pull
        self.clock = self.busy_s = 0.0
        self.it, self.context_sum, self.version, self.pending = 0, 0, 0, None
        self.versions = [(0, 0)]  # (iteration from which, version)
        self.running: Dict[_Seq, None] = {}  # in start order (preemption takes the last)
        self.ends: List = []  # heap of (iteration it finishes at, tie, seq)
        self.waiting: Deque[_Seq] = collections.deque()
        self.preemptions = self.recomputed_tokens = 0
        self._tie = 0

    def fits(self, context: int, n: int = 1) -> bool:
        """Whether ``n`` sequences of ``context`` tokens in all can start: the cache holds them
        and every running sequence's next token (else the next iteration would preempt)."""
        return not self.running or (self.context_sum + context + len(self.running) + n <= self.model.kv_capacity_tokens
                                    and len(self.running) + n <= self.model.max_num_seqs)

    def _start(self, seq: _Seq) -> None:
        dt = self.model.prefill_s_per_token * seq.context
        self.clock, self.busy_s = self.clock + dt, self.busy_s + dt
        if seq.tokens:  # a preempted sequence: its generated tokens are prefilled again
            self.recomputed_tokens += seq.context
        seq.start_it, self.context_sum = self.it, self.context_sum + seq.context
        self.running[seq] = None
        self._tie += 1
        seq.tie = self._tie
        heapq.heappush(self.ends, (self.it + seq.left, self._tie, seq))

    def _fill(self) -> None:
        """Start waiting sequences (preempted ones first), then pull groups, while they fit."""
        if self.pending is not None:  # draining for new weights: nothing new starts
            return
        while True:
            if self.waiting:
                if not self.fits(self.waiting[0].context):
                    return
                self._start(self.waiting.popleft())
                continue
            seqs = self.pull(self)
            if seqs is None:
                return
            self.waiting.extend(_Seq(g, p, r) for g, p, r in seqs)

    def _stop(self, seq: _Seq) -> None:
        """``seq`` leaves the running set: credit its tokens to the versions that made them."""
        done = self.it - seq.start_it
        seq.context, seq.left = seq.context + done, seq.left - done
        self.context_sum -= seq.context
        del self.running[seq]
        i = bisect.bisect_right(self.versions, (seq.start_it, math.inf)) - 1
        for j in range(i, len(self.versions)):
            lo = max(seq.start_it, self.versions[j][0])
            hi = self.it if j + 1 == len(self.versions) else min(self.it, self.versions[j + 1][0])
            if hi > lo:
                seq.tokens[self.versions[j][1]] = seq.tokens.get(self.versions[j][1], 0) + hi - lo

    def load(self, version: int, at: float, pause_s: float, in_flight: bool, recompute_kv: bool) -> None:
        """New weights reach the engine at ``at``: load them now (``in_flight`` or idle) or after
        the running sequences finish."""
        if not in_flight and self.running:
            self.pending = version
            return
        self.clock = max(self.clock, at) + pause_s
        if recompute_kv and self.running:
            dt = self.model.prefill_s_per_token * self.context_sum
            self.clock, self.busy_s, self.recomputed_tokens = self.clock + dt, self.busy_s + dt, \
                self.recomputed_tokens + self.context_sum
        self.version, self.pending = version, None
        self.versions.append((self.it, version))
        self._fill()

    def run(self, until: float, pause_s: float) -> List[Tuple[float, _Seq]]:
        """Decode until ``until`` (an idle engine's clock then moves to it); the finished
        sequences with their finishing times."""
        done: List[Tuple[float, _Seq]] = []
        self._fill()
        while self.running and self.clock < until:
            n, cap = len(self.running), self.model.kv_capacity_tokens
            while n > 1 and self.context_sum + n > cap:  # no room for the next tokens: preempt the newest
                seq = next(reversed(self.running))
                self._stop(seq)
                seq.tie, self.preemptions = -1, self.preemptions + 1
                self.waiting.appendleft(seq)
                n -= 1
            while self.ends[0][1] != self.ends[0][2].tie:  # entries of preempted runs
                heapq.heappop(self.ends)
            m = self.ends[0][0] - self.it
            if n > 1:
                m = min(m, (cap - self.context_sum) // n)
            if self.clock + self.model.time(self.context_sum, n, m) > until:
                m = self.model.iterations_within(self.context_sum, n, until - self.clock, m)
                if m == 0:
                    break
            dt = self.model.time(self.context_sum, n, m)
            self.clock, self.busy_s, self.it, self.context_sum = self.clock + dt, self.busy_s + dt, self.it + m, \
                self.context_sum + n * m
            while self.ends and self.ends[0][0] <= self.it:
                _, tie, seq = heapq.heappop(self.ends)
                if tie == seq.tie:
                    self._stop(seq)
                    done.append((self.clock, seq))
            if self.pending is not None and not self.running:
                self.load(self.pending, self.clock, pause_s, True, False)
            self._fill()
        if until < math.inf and not self.running:
            self.clock = max(self.clock, until)
        return done


def streaming(job: Job, prompts: List[Prompt], steps: int, engine_gpus: int, eta: int, in_flight: bool = True,
              recompute_kv: bool = False, order: str = "completion", engine_tp: Optional[int] = None,
              kv_reserve: float = 1.0, tick_s: float = 0.5, model=None) -> Dict:
    """Streaming rollouts (see the module docstring) on ``engine_gpus`` GPUs of engines of TP
    ``engine_tp``, the trainers on the rest; the trainer's decisions fall on ticks of ``tick_s``
    simulated seconds (their times are exact). ``kv_reserve``: an engine admits a group only if
    its running sequences and the group's, at ``kv_reserve`` x (mean prompt + mean response)
    tokens each, fit its KV cache (as SGLang reserves room for the tokens a running request will
    still generate; below about 0.75 engines preempt by the thousand at the paper's lengths).
    Returns `sim_schedules`' run dict plus ``staleness`` and ``token_age`` (see the module
    docstring; ``step_staleness`` and ``step_token_age``: the same for each step), ``group_done``,
    ``preemptions`` and ``recomputed_tokens``."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if recompute_kv and not in_flight:
        raise ValueError("recompute_kv needs in_flight (a drained engine has no KV cache to recompute)")
    tp, per_step = engine_tp or job.engine_tp, job.prompts_per_step
    model = model or job.decode(tp, separate=True)
    engines, trainers, transfer = engine_gpus // tp, job.num_gpus - engine_gpus, switch_s(job.model, job.eff, False)
    if len(prompts) < (steps + eta + 1) * per_step:
        raise ValueError(f"{len(prompts)} prompts cannot feed {steps} steps of {per_step} at eta={eta}: "
                         f"give (steps + eta + 1) x prompts_per_step = {(steps + eta + 1) * per_step}")
    reserve = kv_reserve * (sum(job.lengths.prompt_range) / 2 + job.lengths.mean_response())
    admitted_under: List[int] = []  # group j's version at admission
    left = [len(p.responses) for p in prompts]
    tokens: List[Dict[int, int]] = [{} for _ in prompts]
    ready: List = []  # (group finished at, group)
    group_done: Dict[int, float] = {}

    def pull(engine: StreamEngine) -> Optional[list]:
        j = len(admitted_under)
        if j >= len(prompts) or j >= (engine.version + eta + 1) * per_step:
            return None
        p = prompts[j]
        if engine.running and (len(engine.running) + len(p.responses)) * reserve > model.kv_capacity_tokens or \
                not engine.fits(len(p.responses) * p.prompt_len, len(p.responses)):
            return None
        admitted_under.append(engine.version)
        return [(j, p.prompt_len, r) for r in p.responses]

    pool = [StreamEngine(model, pull) for _ in range(engines)]

    def advance(until: float) -> None:
        for engine in pool:
            for t, seq in engine.run(until, transfer):
                for v, n in seq.tokens.items():
                    tokens[seq.group][v] = tokens[seq.group].get(v, 0) + n
                left[seq.group] -= 1
                if left[seq.group] == 0:
                    group_done[seq.group] = t
                    heapq.heappush(ready, (t, seq.group))

    clock, trainer_free, training, version, trained = 0.0, 0.0, False, 0, 0
    ends, step_tokens, train_busy = [], [], 0.0
    staleness: List[collections.Counter] = []  # per step
    token_age: List[collections.Counter] = []
    while version < steps:
        if training and trainer_free <= clock + tick_s:  # the update ends: the engines get version + 1
            advance(trainer_free)
            version, training = version + 1, False
            for engine in pool if version < steps else ():  # the last update's weights are not sent
                engine.load(version, trainer_free, transfer, in_flight, recompute_kv)
            continue
        batch = _take(ready, group_done, per_step, trained, order) if not training else None
        if batch is not None:
            trained += per_step
            train = sum(job.train_s([prompts[j] for j in batch], trainers))
            start = max(trainer_free + transfer * (version > 0), max(group_done[j] for j in batch))
            trainer_free = start + train
            ends.append(trainer_free)
            step_tokens.append(sum(sample_tokens([prompts[j] for j in batch])))
            train_busy, training = train_busy + train, True
            staleness.append(collections.Counter(version - admitted_under[j] for j in batch))
            token_age.append(collections.Counter())
            for j in batch:
                for v, n in tokens[j].items():
                    token_age[-1][version - v] += n
            continue
        clock += tick_s
        advance(clock)
    empty = collections.Counter()
    return _run(ends, step_tokens, sum(e.busy_s for e in pool), engines, train_busy,
                staleness=dict(sum(staleness, empty)), token_age=dict(sum(token_age, empty)),
                step_staleness=staleness, step_token_age=token_age, group_done=group_done,
                preemptions=sum(e.preemptions for e in pool), recomputed_tokens=sum(e.recomputed_tokens for e in pool))


def _take(ready: List, group_done: Dict[int, float], per_step: int, trained: int, order: str) -> Optional[List[int]]:
    """The next step's groups if they are complete, else None (``ready`` is a heap of
    (finished at, group) and loses the groups taken)."""
    if order == "admission":
        batch = list(range(trained, trained + per_step))
        if any(j not in group_done for j in batch):
            return None
        taken = set(batch)
        ready[:] = [r for r in ready if r[1] not in taken]
        heapq.heapify(ready)
        return batch
    if len(ready) < per_step:
        return None
    return [heapq.heappop(ready)[1] for _ in range(per_step)]
