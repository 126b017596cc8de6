"""Streaming rollouts on an engine rank (``rollout.streaming``): `StreamPools`, the prompt streams
of the trainer replicas an engine serves, over one `stapo_megatron.serve.streaming.
StreamingGenerator` that never drains.

The trainers send each step's prompts of their replica (``("stream", ticket, jobs, requests)``,
`stapo_megatron.rollout.remote.RemoteEngine.submit_stream`: stream positions in data order, each
prompt's seed, and the groups the step trains: P, or with more engines than replicas a slice of
the replica's prompts and its share of P on each of several engines, each slice a stream of its
own here); the engine server
(`stapo_megatron.serve.server`) takes commands between two decode iterations and
otherwise calls `StreamPools.advance`:

- **Admission.** The replicas' waiting prompts are admitted in turn, one group of G samples at a
  time, while the generator's capacity (running samples, reserved KV tokens) and the
  off-policyness bound allow: a replica's j-th admitted group (0-based) trains at step
  ``base + j // P`` counted in admission order (``base``: the policy version when the replica's
  stream began), and may start only under a policy at most eta (``rollout.max_staleness``)
  versions older (AReaL's ``max_head_offpolicyness``). The trainers send step s + eta's prompts
  after step s's weights, so the supply never runs further ahead than the bound either.
- **Steps.** One decode iteration of every running sample (the generator's ``step``); a group
  is complete when its G samples have finished.
- **Replies.** A replica's requests are answered in the order they were sent (an urgent one,
  dynamic sampling's replacements, before the others, its prompts admitted first and outside
  the bound's count: they train at the step whose trainers wait for them), each with
  its P groups as soon as they are complete: the first P to complete (``stream_order="completion"``)
  or the next P of its admission order (``"admission"``: the data order, whatever the timing).
  The reply carries the groups' stream positions, which the trainers record and checkpoint.
- **Weights** arrive between two iterations (`StreamPools.load`, ``rollout.weight_load``): in
  flight (the running samples keep their KV cache), with the KV cache recomputed, or after a
  drain. Every token keeps the version that sampled it.
- **Evaluation** requests (a blocking ``generate``) first let the running samples finish
  (`StreamPools.drain`: the engine's request loop would otherwise run them to their end inside
  the evaluation's call), then generate; admission resumes after.

Deterministic given the weights' arrival: sample j of a prompt is seeded with the prompt's seed
plus j whatever the engine's load; which iteration new weights arrive at depends on timing, as
in every in-flight-update design, and the tokens' versions say which policy sampled each.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from stapo_megatron.rollout.config import SamplingSettings
from stapo_megatron.rollout.remote import Chunk, Job, PoolRequest
from stapo_megatron.serve.streaming import StreamedGroup, StreamingGenerator
from stapo_megatron.serve.partial import Group

Post = Callable[[int, Chunk, list, float], None]
"""``post(ticket, chunk, [reply], seconds)``: a reply to its asker (`server.serve`)."""


@dataclasses.dataclass
class _Replica:
    """One trainer replica's stream on this engine."""

    stream: Tuple[int, int]
    """(the replica's asking trainer rank, its slice index): its requests' slices on this engine."""
    base_version: int
    """The policy version when the stream began: its j-th admitted group trains at ``base + j // want``."""
    waiting: Deque[Tuple[int, int, List[int], int, bool]] = dataclasses.field(default_factory=collections.deque)
    """(stream position, training-set index, prompt ids, seed, urgent) sent and not admitted yet."""
    requests: Deque[Tuple[int, Chunk, int]] = dataclasses.field(default_factory=collections.deque)
    """(ticket, chunk, groups wanted) not answered yet, in the order sent."""
    admitted: List[int] = dataclasses.field(default_factory=list)
    """Stream positions admitted and not handed out yet, in admission order."""
    complete: Dict[int, StreamedGroup] = dataclasses.field(default_factory=dict)
    """Stream position -> complete group not handed out yet, in completion order."""
    want: int = 0
    groups_admitted: int = 0


class StreamPools:
    """The replicas' streams on one engine (module docstring).

    Args:
        engine: the engine rank's `stapo_megatron.rollout.vllm_engine.VLLMEngine` (vLLM TP 1).
        settings: the replicas' sampling settings (G, temperature, top-p, max tokens; the seeds
            come with each request).
        eta: the off-policyness bound (``rollout.max_staleness``).
        order: ``rollout.stream_order``; mode: ``rollout.weight_load``.
        version: the policy version of the weights the engine holds.
        reserve_tokens: ``rollout.stream_reserve_tokens``, the response tokens of KV reserved
            per admitted sample (None: ``max_tokens``, never preempting).
    """

    def __init__(self, engine, settings: SamplingSettings, eta: int, order: str, mode: str, version: int,
                 reserve_tokens: Optional[int] = None):
        self.settings, self.order, self.mode = settings, order, mode
        self.generator = StreamingGenerator(engine, settings, eta=eta, order="completion", version=version,
                                            reserve_tokens=reserve_tokens)
        self.replicas: Dict[Tuple[int, int], _Replica] = {}
        """(asking trainer rank, slice index) -> its stream: one per replica, or per slice of a
        replica's prompts when a replica's step is sliced over several engines."""
        self.stepping = 0.0
        """Seconds in decode iterations since the last reply (the reply's ``generate`` time)."""

    def add(self, ticket: int, jobs: List[Job], requests: Dict[Tuple[int, int], PoolRequest]) -> None:
        """A step's prompts (``jobs``: this engine's slices of the asking replicas' prompts) into
        their streams, and each slice's request (``requests[(asker, slice index)]``) for its
        ``want`` complete groups."""
        for chunk, prompts, settings in jobs:
            if dataclasses.replace(settings, seed=None) != dataclasses.replace(self.settings, seed=None):
                raise ValueError(f"streaming rollouts sample every step alike; trainer rank {chunk.dest} asked with "
                                 f"{settings}, the stream runs {self.settings}")
            request = requests[(chunk.dest, chunk.index)]
            stream = (chunk.dest, chunk.index)
            replica = self.replicas.setdefault(stream, _Replica(stream, self.generator.version, want=request.want))
            entries = [(position, index, list(ids), settings.skip(i).seed or 0, request.urgent)
                       for i, (position, index, ids) in enumerate(prompts)]
            if request.urgent:  # a step's replacements: its trainers wait for them now
                replica.waiting.extendleft(reversed(entries))
                replica.requests.appendleft((ticket, chunk, request.want))
            else:
                replica.waiting.extend(entries)
                replica.requests.append((ticket, chunk, request.want))

    def answer(self, post: Post) -> None:
        """Answer the requests whose groups are complete (a request for no groups at once)."""
        for replica in self.replicas.values():
            self._answer(replica, post)

    @property
    def busy(self) -> bool:
        """Samples are running, or a waiting prompt could start now."""
        return self.generator.num_running_samples > 0 or any(
            r.waiting and self._refusal(r) is None for r in self.replicas.values())

    def _trained(self, replica: _Replica, urgent: bool) -> int:
        """The step the replica's next group trains at: by the bound's count, or (an urgent
        replacement) the step its trainers wait in, which the engine's weights never trail by
        more than eta."""
        if urgent:
            return self.generator.version
        return replica.base_version + replica.groups_admitted // max(1, replica.want)

    def _refusal(self, replica: _Replica):
        _, _, ids, _, urgent = replica.waiting[0]
        return self.generator.refusal(len(ids), self._trained(replica, urgent))

    def admit(self) -> int:
        """Admit waiting groups, one replica's at a time in turn, while the generator allows;
        returns how many."""
        admitted, progress = 0, True
        while progress:
            progress = False
            for replica in self.replicas.values():
                if replica.waiting and self._refusal(replica) is None:
                    position, index, ids, seed, urgent = replica.waiting.popleft()
                    assert self.generator.admit(ids, seed, self._trained(replica, urgent),
                                                key=(position, index, replica.stream))
                    replica.groups_admitted += not urgent  # the bound counts the steps' own groups
                    replica.admitted.append(position)
                    admitted += 1
                    progress = True
        return admitted

    def advance(self, post: Post) -> None:
        """Admit what may start, run one decode iteration, and answer the requests it completed."""
        self.admit()
        self._iterate(post)

    def drain(self, post: Post) -> int:
        """Run the running samples to their end, admitting nothing; returns the iterations."""
        iterations = 0
        while self.generator.num_running_samples:
            self._iterate(post)
            iterations += 1
        return iterations

    def load(self, named_tensors, version: int) -> None:
        """New weights (a streamed transfer) as ``version``, in ``rollout.weight_load``'s mode."""
        self.generator.load_weights(named_tensors, version, self.mode)

    def abort(self) -> int:
        """Drop every running request (a stop); returns how many."""
        return self.generator.abort()

    def _iterate(self, post: Post) -> None:
        started = time.perf_counter()
        self.generator.step()
        self.stepping += time.perf_counter() - started
        for group in self.generator.take():
            position, _, stream = group.key
            self.replicas[stream].complete[position] = group
        self.answer(post)

    def _answer(self, replica: _Replica, post: Post) -> None:
        while replica.requests:
            ticket, chunk, want = replica.requests[0]
            if self.order == "completion":
                ready = list(replica.complete)
            else:
                ready = []
                for position in replica.admitted:
                    if position not in replica.complete:
                        break
                    ready.append(position)
            if len(ready) < want:
                return
            replica.requests.popleft()
            taken = ready[:want]
            groups = [replica.complete.pop(p) for p in taken]
            taken_set = set(taken)
            replica.admitted = [p for p in replica.admitted if p not in taken_set]
            reply = dict(groups=[Group(g.key[1], g.prompt_token_ids, g.samples) for g in groups], positions=taken,
                         pool=len(replica.admitted), waiting=len(replica.waiting), continued=0)
            post(ticket, chunk, [reply], self.stepping)
            self.stepping = 0.0
