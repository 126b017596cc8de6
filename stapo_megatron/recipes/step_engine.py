"""One vLLM engine over the calibrated decode model (`stapo_megatron.recipes.step_model.
DecodeModel`): continuous batching with a KV cache of bounded size. The dry run's step estimate
(`step_model.generation_s`) runs it on a recipe's lengths, and the rollout-schedule simulator
(``benchmarks/sim_schedules.py``, ``sim_streaming.py``) under every schedule.

- **Decode.** Every running sequence gains one token an iteration; ``m`` iterations over ``n``
  sequences whose contexts sum to ``C`` cost ``DecodeModel.time(C, n, m)``; a sequence leaves
  when its response is complete.
- **Admission** (vLLM's scheduler). Waiting sequences start in line: the first starts, paying
  the prefill of its context, when the cache holds its context and every running sequence's next
  token (else the next iteration would preempt) and fewer than ``max_num_seqs`` run. A sequence
  starts on an empty engine whatever its size.
- **Preemption** (vLLM's recompute preemption). When the running sequences' next tokens do not
  fit, the most recently started one gives up its blocks and waits first in line; when it starts
  again it pays the prefill of its whole context, prompt and the tokens it had generated
  (``recomputed_tokens``). A lone sequence is never preempted.
- **Weights.** Every token keeps the version of the weights that generated it (`Seq.tokens`).
  `Engine.load` takes new weights between two decode iterations (in flight, the KV cache kept or
  prefilled again) or after the running sequences finish (drained).

Sequences come from `Engine.admit` (a prompt's responses, queued at once) or from ``pull``,
which the engine calls whenever its line is empty and it could start more (a schedule's own
admission policy: the streaming simulator's off-policyness bound and KV reservation).
"""

from __future__ import annotations

import bisect
import collections
import heapq
import math
from typing import Callable, Deque, Dict, List, Optional, Tuple


class Seq:
    """One sequence: its ``group`` (prompt index, or a schedule's admission index), the
    ``version`` it was queued under, its ``context`` and tokens ``left`` when it last stopped,
    and ``tokens``: version -> tokens that version generated."""

    __slots__ = ("group", "version", "context", "left", "start_it", "tie", "tokens")

    def __init__(self, group: int, context: int, left: int, version: int = 0):
        self.group, self.version, self.context, self.left = group, version, context, left
        self.start_it, self.tie = 0, 0
        self.tokens: Dict[int, int] = {}


class Engine:
    """One vLLM engine (see the module docstring), its clock starting at ``clock``; ``pull(engine)``
    returns the next sequences [(group, prompt_len, response_len)] to queue, or None (no more for
    now). ``busy_s``: decode and prefill seconds; ``preemptions``; ``recomputed_tokens``: context
    tokens prefilled again (after a preemption, or a load with ``recompute_kv``);
    ``peak_context``: the most context tokens the running sequences held at once."""

    def __init__(self, model, clock: float = 0.0, pull: Optional[Callable[["Engine"], Optional[list]]] = None):
        self.model, self.clock, self.pull = model, clock, pull
        self.busy_s = 0.0
        self.it, self.context_sum, self.version, self.pending = 0, 0, 0, None
        self.versions = [(0, 0)]  # (iteration from which, version)
        self.running: Dict[Seq, None] = {}  # in start order (preemption takes the last)
        self.ends: List = []  # heap of (iteration it finishes at, tie, seq)
        self.waiting: Deque[Seq] = collections.deque()
        self.preemptions = self.recomputed_tokens = self.peak_context = 0
        self._tie = 0

    @property
    def num_sequences(self) -> int:
        """Running and waiting sequences."""
        return len(self.running) + len(self.waiting)

    def admit(self, prompt, version: int, responses: Optional[List[int]] = None) -> None:
        """Queue ``responses`` (default: all) of ``prompt`` (a `step_model.Prompt`) under ``version``;
        each starts when admission allows."""
        self.waiting.extend(Seq(prompt.index, prompt.prompt_len, r, version) for r in (responses or prompt.responses))
        self._fill()

    def fits(self, context: int, n: int = 1) -> bool:
        """Whether ``n`` sequences of ``context`` tokens in all can start: the cache holds them
        and every running sequence's next token, and fewer than ``max_num_seqs`` would run."""
        held = (len(self.running) + n) * self.model.seq_tokens
        return not self.running or (self.context_sum + context + held <= self.model.kv_capacity_tokens
                                    and len(self.running) + n <= self.model.max_num_seqs)

    def _start(self, seq: Seq) -> None:
        dt = self.model.prefill_s_per_token * seq.context
        self.clock, self.busy_s = self.clock + dt, self.busy_s + dt
        if seq.tokens:  # a preempted sequence: its generated tokens are prefilled again
            self.recomputed_tokens += seq.context
        seq.start_it, self.context_sum = self.it, self.context_sum + seq.context
        self.peak_context = max(self.peak_context, self.context_sum)
        self.running[seq] = None
        self._tie += 1
        seq.tie = self._tie
        heapq.heappush(self.ends, (self.it + seq.left, self._tie, seq))

    def _fill(self) -> None:
        """Start waiting sequences (preempted ones first), then pulled ones, while they fit."""
        if self.pending is not None:  # draining for new weights: nothing new starts
            return
        while True:
            if self.waiting:
                if not self.fits(self.waiting[0].context):
                    return
                self._start(self.waiting.popleft())
                continue
            seqs = self.pull(self) if self.pull is not None else None
            if seqs is None:
                return
            self.waiting.extend(Seq(g, p, r, self.version) for g, p, r in seqs)

    def _stop(self, seq: Seq) -> None:
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

    def _preempt(self) -> None:
        """Preempt the newest running sequences until every running one's next token fits."""
        while len(self.running) > 1 and (self.context_sum + len(self.running) * self.model.seq_tokens
                                         > self.model.kv_capacity_tokens):
            seq = next(reversed(self.running))
            self._stop(seq)
            seq.tie, self.preemptions = -1, self.preemptions + 1
            self.waiting.appendleft(seq)

    def load(self, version: int, at: float, pause_s: float, in_flight: bool = True, recompute_kv: bool = False) -> None:
        """New weights reach the engine at ``at`` and take ``pause_s`` to load: now (``in_flight``,
        or an idle engine; ``recompute_kv``: then prefill every running context again) or after
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

    def run(self, until: float = math.inf, pause_s: float = 0.0) -> List[Tuple[float, Seq]]:
        """Decode until ``until`` or until nothing runs (an idle engine's clock then moves to a
        finite ``until``; a busy one keeps its own); the finished sequences with their finishing
        times. ``pause_s``: the load of weights that wait for a drain."""
        done: List[Tuple[float, Seq]] = []
        self._fill()
        while self.running and self.clock < until:
            self._preempt()
            while self.ends[0][1] != self.ends[0][2].tie:  # entries of preempted runs
                heapq.heappop(self.ends)
            n, cap = len(self.running), self.model.kv_capacity_tokens
            m = self.ends[0][0] - self.it
            if n > 1:  # up to the iteration whose next tokens would not fit
                m = min(m, (cap - self.context_sum - n * (self.model.seq_tokens - 1)) // n)
            if self.clock + self.model.time(self.context_sum, n, m) > until:
                m = self.model.iterations_within(self.context_sum, n, until - self.clock, m)
                if m == 0:
                    break
            dt = self.model.time(self.context_sum, n, m)
            self.clock, self.busy_s, self.it, self.context_sum = self.clock + dt, self.busy_s + dt, self.it + m, \
                self.context_sum + n * m
            self.peak_context = max(self.peak_context, self.context_sum)
            while self.ends and self.ends[0][0] <= self.it:
                _, tie, seq = heapq.heappop(self.ends)
                if tie == seq.tie:
                    self._stop(seq)
                    done.append((self.clock, seq))
            if self.pending is not None and not self.running:
                self.load(self.pending, self.clock, pause_s)
            self._fill()
        if until < math.inf and not self.running:
            self.clock = max(self.clock, until)
        return done
