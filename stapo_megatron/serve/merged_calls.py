"""Several askers' ``generate`` calls as one engine call: what an engine rank of separate placement
does when it holds more than one trainer replica's share of a request
(`stapo_megatron.serve.server`).

An engine generates a batch as one continuously batched decode: the call ends with its longest
response (its tail). Calls made one after another pay one tail each; merged, the askers' prompts
share the decode and the request pays one tail. Each prompt keeps its own seeds (the engines'
per-prompt seeds, `stapo_megatron.rollout.base.prompt_seeds`), so a merged call draws the same
samples as the calls it replaces, up to the float rounding of a different batch (a padded HF
batch, vLLM's batch-dependent kernels).

- `generate_merged`: calls (`Call`: prompts and their `stapo_megatron.rollout.config.
  SamplingSettings`) whose settings differ at most in the seed (seeded or not alike) go to the
  engine as one call, split back after; each call's share of the engine seconds is its share of
  the tokens generated.
- `step_together`: functions that make their own sequences of calls (partial rollouts' pools, one
  per asking replica: `stapo_megatron.serve.partial.PartialPool.step`) run in lockstep, each in
  a thread of its own: once every function still running has made its next call, those calls go
  to the engine merged, from the caller's thread (the one the engine runs on). Which calls merge
  depends only on the functions' calls, never on timing: the same inputs give the same batches.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from stapo_megatron.rollout.base import prompt_seeds
from stapo_megatron.rollout.config import SamplingSettings


@dataclasses.dataclass
class Call:
    """One ``engine.generate`` call: its prompts and what they sample with."""

    prompts: List[List[int]]
    settings: SamplingSettings

    def key(self) -> tuple:
        """Calls of equal keys can share one engine call: equal settings but the seed, and
        seeded or not alike."""
        return dataclasses.replace(self.settings, seed=None), self.settings.seed is None


def generate_merged(engine, calls: Sequence[Call]) -> List[Tuple[list, float]]:
    """``(samples, seconds)`` of each call, in order: the calls of equal `Call.key` in one engine
    call each (in their order), calls without prompts answered ``[]`` without one. ``seconds``:
    the merged call's time times the call's share of the tokens it generated."""
    out: List[Optional[Tuple[list, float]]] = [None if c.prompts else ([], 0.0) for c in calls]
    keys: Dict[tuple, List[int]] = {}
    for i, call in enumerate(calls):
        if call.prompts:
            keys.setdefault(call.key(), []).append(i)
    for members in keys.values():
        first = calls[members[0]].settings
        prompts = [ids for i in members for ids in calls[i].prompts]
        seeds = None if first.seed is None else \
            [s for i in members for s in prompt_seeds(calls[i].settings.seed, len(calls[i].prompts), first.n)]
        started = time.perf_counter()
        samples = first.generate(engine, prompts, prompt_seeds=seeds)
        took = time.perf_counter() - started
        start, parts = 0, []
        for i in members:
            parts.append(samples[start:start + len(calls[i].prompts)])
            start += len(calls[i].prompts)
        tokens = [sum(len(s.token_ids) for group in part for s in group) for part in parts]
        for i, part, count in zip(members, parts, tokens):
            out[i] = (part, took * (count / sum(tokens) if sum(tokens) else 1 / len(members)))
    return out


class _Asker:
    """The engine as one of `step_together`'s functions sees it: ``generate`` (the engine's
    `RolloutEngine` arguments, as `SamplingSettings.generate` passes them) waits for the
    lockstep's merged call; ``detokenize`` is the engine's (its tokenizer only)."""

    def __init__(self, lockstep: "_Lockstep", index: int):
        self.lockstep, self.index = lockstep, index
        self.seconds = 0.0
        """This function's share of the engine seconds (`generate_merged`)."""

    def generate(self, prompt_token_ids, n, temperature, top_p, max_tokens, seed=None):
        settings = SamplingSettings(n, temperature, top_p, max_tokens, seed)
        return self.lockstep.ask(self, Call([list(p) for p in prompt_token_ids], settings))

    def detokenize(self, token_ids):
        return self.lockstep.engine.detokenize(token_ids)


class _Lockstep:
    def __init__(self, engine, count: int):
        self.engine, self.cond = engine, threading.Condition()
        self.asked: Dict[int, Call] = {}
        self.answers: Dict[int, object] = {}
        self.running = set(range(count))
        self.done: set = set()
        """Functions that have returned (or raised)."""

    def ask(self, asker: _Asker, call: Call):
        with self.cond:
            self.asked[asker.index] = call
            self.cond.notify_all()
            self.cond.wait_for(lambda: asker.index in self.answers)
            answer = self.answers.pop(asker.index)
        if isinstance(answer, BaseException):
            raise answer
        samples, seconds = answer
        asker.seconds += seconds
        return samples

    def serve(self, finished: Callable[[int], None]) -> None:
        """Until every function has returned: wait for every running one to ask, then answer
        them with one `generate_merged`; ``finished(i)`` as soon as function i has returned."""
        reported = set()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: all(i in self.asked for i in self.running))
                asked, self.asked = dict(sorted(self.asked.items())), {}
                running, done = set(self.running), set(self.done)
            for i in sorted(done - reported):
                reported.add(i)
                finished(i)
            if not running:
                return
            try:
                answers = dict(zip(asked, generate_merged(self.engine, list(asked.values()))))
            except BaseException as error:  # noqa: BLE001  (each asker raises it in its thread)
                answers = dict.fromkeys(asked, error)
            with self.cond:
                self.answers.update(answers)
                self.cond.notify_all()


def step_together(engine, steps: Sequence[Callable], finished: Callable[[int, object, float], None]) -> None:
    """Run ``steps[i](asker)`` for every i in lockstep (module docstring), ``asker`` standing in for
    ``engine``; ``finished(i, result, seconds)`` (on this thread) as soon as step i has returned,
    ``seconds`` its share of the engine's time. One step runs on ``engine`` itself."""
    if len(steps) == 1:
        started = time.perf_counter()
        result = steps[0](engine)
        finished(0, result, time.perf_counter() - started)
        return
    lockstep = _Lockstep(engine, len(steps))
    askers = [_Asker(lockstep, i) for i in range(len(steps))]
    results: Dict[int, object] = {}
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = steps[i](askers[i])
        except BaseException as error:  # noqa: BLE001  (raised by the caller)
            errors.append(error)
        finally:
            with lockstep.cond:
                lockstep.running.discard(i)
                lockstep.done.add(i)
                lockstep.cond.notify_all()

    threads = [threading.Thread(target=run, args=(i,), name=f"engine-asker-{i}", daemon=True)
               for i in range(len(steps))]
    for thread in threads:
        thread.start()

    def report(i: int) -> None:
        if i in results:
            finished(i, results[i], askers[i].seconds)

    lockstep.serve(report)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
