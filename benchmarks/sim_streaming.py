"""Streaming rollouts over the cost model of `sim_model.py`: engines that never drain, admission
bounded by an off-policyness eta, the trainer taking complete groups, in-flight weight updates.

- **Streams** (``schedule``): how a step's prompts reach the engines. The trainers are
  R = trainer GPUs / ``Job.trainer_replica_gpus`` data-parallel replicas, each with P / R of a
  step's prompts (contiguous in data order). ``"slices"`` is what the project builds
  (`stapo_megatron.rollout.remote.plan_chunks` and `stapo_megatron.serve.stream_pools`): each
  replica's prompts are cut into ceil(E / R) fixed slices of a step, slice j of replica i going
  to engine (i x slices + j) mod E, and every slice is a stream of its own on its engine, with
  its own quota (its share of the replica's groups a step) and its own eta count. ``"queue"``:
  each replica's prompts form one stream that every engine of the replica (the engines its
  slices would go to) admits from when it has room. ``"shared"``: one stream of all prompts
  that every engine admits from (R = 1 whatever the trainers).
- **Admission.** A stream's prompts are admitted in order, each as a group of its G samples, to
  the engine of the stream that asks first (an engine with several streams asks for them in
  turn): an engine asks whenever its KV cache has room for the group's prompts and every
  running sequence's next token, fewer than ``max_num_seqs`` sequences run, and its running
  sequences and the group's fit the cache at a reservation of ``kv_reserve`` x the mean
  sequence each (as SGLang, and the project's ``rollout.streaming.reserve_tokens``, reserve room
  for the tokens a running request will still generate). A stream's group j (0-based, in its
  admission order) belongs to step s = j // w (w: the stream's quota a step) and may start only
  on an engine whose loaded weights are at least version s - eta: AReaL's
  ``max_head_offpolicyness``, counted per group wherever it runs, so the version a group starts
  under is at least the version that trains it less eta when groups train in admission order.
- **Training.** A step trains every stream's w complete groups as soon as every stream has them
  and the trainer is free (after sending the previous weights): ``order="completion"`` takes
  each stream's first w to finish (the order is timing's; a slow group can wait longer than eta
  steps), ``order="admission"`` its next w in admission order (the data order is the admission
  order and the request-level bound is exact, at the cost of waiting for the slowest group of
  each step). With slices a step waits for the slowest of its E streams.
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
import dataclasses
import heapq
import math
from typing import Dict, List, Optional

from sim_engine import Engine
from sim_model import Prompt, sample_tokens, switch_s
from sim_schedules import Job, _run

ORDERS = ("completion", "admission")
SCHEDULES = ("queue", "slices", "shared")


@dataclasses.dataclass
class Stream:
    """Prompts admitted in order by its ``engines``, ``quota`` of them a step."""

    engines: List[int]
    quota: int
    prompts: List[int] = dataclasses.field(default_factory=list)
    """Global prompt indices in the stream's admission order."""
    admitted: int = 0
    trained: int = 0
    ready: List = dataclasses.field(default_factory=list)
    """Heap of (finished at, prompt) of complete groups not trained."""


def plan_streams(schedule: str, prompts: int, per_step: int, engines: int, replicas: int) -> List[Stream]:
    """The streams of ``schedule`` (module docstring) over ``prompts`` prompts in data order (steps
    of ``per_step``), on ``engines`` engines for ``replicas`` trainer replicas."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "shared":
        return [Stream(list(range(engines)), per_step, list(range(prompts)))]
    if per_step % replicas:
        raise ValueError(f"prompts_per_step={per_step} does not split over {replicas} trainer replicas")
    own, slices = per_step // replicas, max(1, math.ceil(engines / replicas))
    streams = []
    for i in range(replicas):
        cuts = [own * j // slices for j in range(slices + 1)]
        parts = [(cuts[j], cuts[j + 1], [(i * slices + j) % engines]) for j in range(slices)] \
            if schedule == "slices" else [(0, own, sorted({(i * slices + j) % engines for j in range(slices)}))]
        for lo, hi, on in parts:
            if hi == lo:
                continue
            stream = Stream(on, hi - lo)
            for s in range(math.ceil(prompts / per_step)):
                first = s * per_step + i * own
                stream.prompts += [g for g in range(first + lo, first + hi) if g < prompts]
            streams.append(stream)
    return streams


def streaming(job: Job, prompts: List[Prompt], steps: int, engine_gpus: int, eta: int, in_flight: bool = True,
              recompute_kv: bool = False, order: str = "completion", engine_tp: Optional[int] = None,
              kv_reserve: float = 1.0, tick_s: float = 0.5, model=None, schedule: str = "queue") -> Dict:
    """Streaming rollouts (see the module docstring) on ``engine_gpus`` GPUs of engines of TP
    ``engine_tp``, the trainers on the rest; the trainer's decisions fall on ticks of ``tick_s``
    simulated seconds (their times are exact). ``schedule``: "slices" (as built), "queue" or
    "shared". ``kv_reserve``: an engine admits a group only if its running sequences and the
    group's, at ``kv_reserve`` x (mean prompt + mean response) tokens each, fit its KV cache
    (below about 0.75 engines preempt by the thousand at the paper's lengths). Returns
    `sim_schedules`' run dict plus ``staleness`` and ``token_age`` (see the module docstring;
    ``step_staleness`` and ``step_token_age``: the same for each step) and ``group_done``."""
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
    streams = plan_streams(schedule, len(prompts), per_step, engines,
                           max(1, trainers // job.trainer_replica_gpus))
    on_engine: List[List[Stream]] = [[] for _ in range(engines)]
    for stream in streams:
        for e in stream.engines:
            on_engine[e].append(stream)
    turn = [0] * engines
    reserve = kv_reserve * (sum(job.lengths.prompt_range) / 2 + job.lengths.mean_response())
    admitted_under: Dict[int, int] = {}  # group -> version at admission
    left = [len(p.responses) for p in prompts]
    tokens: List[Dict[int, int]] = [{} for _ in prompts]
    group_done: Dict[int, float] = {}
    stream_of = {g: stream for stream in streams for g in stream.prompts}

    def pull(engine: Engine) -> Optional[list]:
        mine = on_engine[engine.tag]
        for k in range(len(mine)):
            stream = mine[(turn[engine.tag] + k) % len(mine)]
            j = stream.admitted
            if j >= len(stream.prompts) or j >= (engine.version + eta + 1) * stream.quota:
                continue
            p = prompts[stream.prompts[j]]
            if engine.running and (len(engine.running) + len(p.responses)) * reserve > model.kv_capacity_tokens or \
                    not engine.fits(len(p.responses) * p.prompt_len, len(p.responses)):
                return None  # the engine is full: no stream's group fits either
            turn[engine.tag] = (turn[engine.tag] + k + 1) % len(mine)
            stream.admitted += 1
            admitted_under[stream.prompts[j]] = engine.version
            return [(stream.prompts[j], p.prompt_len, r) for r in p.responses]
        return None

    pool = []
    for e in range(engines):
        pool.append(Engine(model, pull=pull))
        pool[-1].tag = e

    def advance(until: float) -> None:
        for engine in pool:
            for t, seq in engine.run(until, transfer):
                for v, n in seq.tokens.items():
                    tokens[seq.group][v] = tokens[seq.group].get(v, 0) + n
                left[seq.group] -= 1
                if left[seq.group] == 0:
                    group_done[seq.group] = t
                    heapq.heappush(stream_of[seq.group].ready, (t, seq.group))

    clock, trainer_free, training, version = 0.0, 0.0, False, 0
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
        batch = _take(streams, group_done, order) if not training else None
        if batch is not None:
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
                group_done=group_done, streams=len(streams))


def _take(streams: List[Stream], group_done: Dict[int, float], order: str) -> Optional[List[int]]:
    """The next step's groups if every stream has its quota complete, else None (the streams
    lose the groups taken)."""
    if order == "admission":
        if any(g not in group_done for s in streams for g in s.prompts[s.trained:s.trained + s.quota]):
            return None
        batch = []
        for s in streams:
            taken = set(s.prompts[s.trained:s.trained + s.quota])
            batch += s.prompts[s.trained:s.trained + s.quota]
            s.ready[:] = [r for r in s.ready if r[1] not in taken]
            heapq.heapify(s.ready)
            s.trained += s.quota
        return batch
    if any(len(s.ready) < s.quota for s in streams):
        return None
    return [heapq.heappop(s.ready)[1] for s in streams for _ in range(s.quota)]
