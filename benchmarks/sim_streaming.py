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
- **KV cache.** The engines are `sim_engine.Engine`s, the same as every schedule's: a sequence
  starts while the cache has room and, when the running sequences' next tokens do not fit, the
  most recently started one is preempted (vLLM's recompute preemption) and pays the prefill of
  its whole context when it starts again. The reservation above is this schedule's own
  admission, on top of the engine's.

Every token keeps the version that produced it: ``token_age`` counts trained tokens by (version
trained - version that generated the token), ``staleness`` trained groups by (version trained -
version their group was admitted under).
"""

from __future__ import annotations

import collections
import heapq
from typing import Dict, List, Optional

from sim_engine import Engine
from sim_model import Prompt, sample_tokens, switch_s
from sim_schedules import Job, _run

ORDERS = ("completion", "admission")


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
    docstring; ``step_staleness`` and ``step_token_age``: the same for each step) and
    ``group_done``."""
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

    def pull(engine: Engine) -> Optional[list]:
        j = len(admitted_under)
        if j >= len(prompts) or j >= (engine.version + eta + 1) * per_step:
            return None
        p = prompts[j]
        if engine.running and (len(engine.running) + len(p.responses)) * reserve > model.kv_capacity_tokens or \
                not engine.fits(len(p.responses) * p.prompt_len, len(p.responses)):
            return None
        admitted_under.append(engine.version)
        return [(j, p.prompt_len, r) for r in p.responses]

    pool = [Engine(model, pull=pull) for _ in range(engines)]

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
    return _run(ends, step_tokens, pool, engines, train_busy, staleness=dict(sum(staleness, empty)),
                token_age=dict(sum(token_age, empty)), step_staleness=staleness, step_token_age=token_age,
                group_done=group_done)


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
