"""Streaming rollouts on an engine rank (``rollout.mode="streaming"``): `StreamPools`, the admission
queues of the trainer replicas an engine serves, over one `stapo_megatron.serve.streaming.
StreamingGenerator` that never drains.

The trainers send each step's prompts of their replica (``("stream", ticket, jobs, requests)``,
`stapo_megatron.rollout.remote.RemoteEngine.submit_stream`: stream positions in data order, each
prompt's seed, and the groups a step trains, P) to every engine of the replica (one, or with more
engines than replicas several); each of them appends them to its copy of the replica's
**admission queue**, the same on every engine (the commands arrive in one order). The engine
server (`stapo_megatron.serve.server`) takes commands between two decode iterations and
otherwise calls `StreamPools.advance`:

- **Admission.** Whichever of the replica's engines has room admits the queue's next group: an
  engine with room for G more samples and their KV reservation claims the next unclaimed entry
  (`Claims`: an atomic claim in the job's store, `StoreClaims`, when several engines share the
  queue) and admits it. Queue entry j (0-based, the replica's own steps' prompts in data order)
  trains at step ``base + j // P`` (``base``: the policy version when the replica's queue began,
  the same on every engine) and may start only under a policy at most eta
  (``rollout.separate.max_staleness``) versions older: on the engine that claims it, whichever that is
  (AReaL's ``max_head_offpolicyness``, counted per group). The trainers send step s + eta's
  prompts after step s's weights, so the supply never runs further ahead than the bound either.
- **Urgent prompts** (dynamic sampling's replacements) form a queue of their own, claimed before
  the steps' and outside the bound's count: they train at the step whose trainers wait for them.
- **Steps.** One decode iteration of every running sample (the generator's ``step``); a group
  is complete when its G samples have finished.
- **Replies.** Each complete group is posted to its replica's asking rank at once, with its stream
  position and queue index (`stapo_megatron.rollout.remote.STREAMED`); the trainers take a step's
  P groups from what all of the replica's engines posted: the first P to arrive
  (``rollout.streaming.order="completion"``) or the next P of the queue (``"admission"``: the data order,
  whatever the timing).
- **Weights** arrive between two iterations (`StreamPools.load`, ``rollout.streaming.weight_load``): in
  flight (the running samples keep their KV cache), with the KV cache recomputed, or after a
  drain. Every token keeps the version that sampled it.
- **Evaluation** requests (a blocking ``generate``) first let the running samples finish
  (`StreamPools.drain`: the engine's request loop would otherwise run them to their end inside
  the evaluation's call), then generate; admission resumes after.

Deterministic given the weights' arrival and the claims: sample j of a prompt is seeded with the
prompt's seed plus j whatever engine runs it; which engine claims a group and which iteration new
weights arrive at depend on timing, as in every in-flight-update design, and the tokens' versions
say which policy sampled each.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Tuple

from stapo_megatron.rollout.config import SamplingSettings
from stapo_megatron.rollout.remote import STREAMED, Chunk, Job, PoolRequest
from stapo_megatron.serve.streaming import StreamingGenerator
from stapo_megatron.serve.partial import Group

Post = Callable[[int, Chunk, list, float], None]
"""``post(ticket, chunk, [reply], seconds)``: a reply to its asker (`server.serve`)."""
Entry = Tuple[int, int, List[int], int]
"""(stream position, training-set index, prompt ids, seed): one prompt of an admission queue."""


class LocalClaims:
    """The claims of queues no other engine shares: a counter per queue, in this process."""

    def __init__(self):
        self.next: Dict[str, int] = {}

    def first(self, queue: str) -> int:
        """The lowest queue index that may still be unclaimed."""
        return self.next.get(queue, 0)

    def claim(self, queue: str, index: int) -> bool:
        """Claim entry ``index`` (>= `first`) for this engine; False when another has it."""
        self.next[queue] = index + 1
        return True


class StoreClaims:
    """The claims of queues that several engines share, in the job's store (`stapo_megatron.
    rollout.transport.Transport.store`): entry j of a queue is this engine's when the store's
    compare-and-set of its key from empty to this engine's name succeeds (exactly one engine's
    does); a counter per queue says from where to look (it trails the claims, never passes them).

    Args:
        store: a ``torch.distributed.Store``.
        name: this engine's name (unique in the job).
    """

    def __init__(self, store, name: str):
        self.store, self.name = store, name
        self.seen: Dict[str, int] = {}

    def first(self, queue: str) -> int:
        self.seen[queue] = max(self.seen.get(queue, 0), self.store.add(f"{queue}/next", 0))
        return self.seen[queue]

    def claim(self, queue: str, index: int) -> bool:
        if self.store.compare_set(f"{queue}/{index}", "", self.name).decode() != self.name:
            self.seen[queue] = max(self.seen.get(queue, 0), index + 1)
            return False
        self.store.add(f"{queue}/next", 1)
        self.seen[queue] = max(self.seen.get(queue, 0), index + 1)
        return True


@dataclasses.dataclass
class _Queue:
    """One of a replica's admission queues, as this engine holds it: the entries from ``start``
    on (those before were claimed, by this engine or another)."""

    name: str
    start: int = 0
    entries: List[Tuple[int, Entry]] = dataclasses.field(default_factory=list)
    """(ticket that sent it, entry) from queue index ``start`` on."""

    def entry(self, index: int) -> Optional[Tuple[int, Entry]]:
        """Entry ``index`` (dropping those here before it: claimed), None if not here yet (other
        engines may have claimed entries this one has not received: they still count)."""
        dropped = min(max(0, index - self.start), len(self.entries))
        del self.entries[:dropped]
        self.start += dropped
        return self.entries[index - self.start] if index - self.start < len(self.entries) else None

    def __len__(self) -> int:
        return len(self.entries)


@dataclasses.dataclass
class _Replica:
    """One trainer replica's admission queues on this engine."""

    dest: int
    """The replica's asking trainer rank: its groups are posted there."""
    chunk: Chunk
    """Where its groups go: the replica's part of a command, its index `STREAMED`."""
    base_version: int
    """The policy version when the queue began: entry j trains at ``base + j // want``."""
    want: int
    steps: _Queue
    urgent: _Queue
    running: int = 0
    """Groups of the replica admitted here and not complete yet."""


class StreamPools:
    """The replicas' admission queues on one engine (module docstring).

    Args:
        engine: the engine rank's `stapo_megatron.rollout.vllm_engine.VLLMEngine` (vLLM TP 1).
        settings: the replicas' sampling settings (G, temperature, top-p, max tokens; the seeds
            come with each request).
        max_staleness: the off-policyness bound eta (``rollout.separate.max_staleness``).
        mode: ``rollout.streaming.weight_load``.
        version: the policy version of the weights the engine holds.
        reserve_tokens: ``rollout.streaming.reserve_tokens``, the response tokens of KV reserved
            per admitted sample (None: ``max_tokens``, never preempting).
        claims: where the queues that several engines share are claimed (`StoreClaims`); a
            queue of this engine alone is counted here (`LocalClaims`), as every queue is with None.
    """

    def __init__(self, engine, settings: SamplingSettings, max_staleness: int, mode: str, version: int,
                 reserve_tokens: Optional[int] = None, claims=None):
        self.settings, self.mode = settings, mode
        self.generator = StreamingGenerator(engine, settings, max_staleness=max_staleness, order="completion", version=version,
                                            reserve_tokens=reserve_tokens)
        self.local, self.shared = LocalClaims(), claims
        self.replicas: Dict[int, _Replica] = {}
        """Asking trainer rank -> its replica's queues."""
        self.claims: Dict[int, object] = {}
        """Asking trainer rank -> the claims of its queues (shared or local)."""
        self.stepping = 0.0
        """Seconds in decode iterations since the last reply (the reply's ``generate`` time)."""
        self._blocked: Optional[tuple] = None
        """The generator's state when nothing could be admitted (nothing is tried again before it changes)."""

    def add(self, ticket: int, jobs: List[Job], requests: Dict[int, PoolRequest], sharing: Dict[int, int]) -> None:
        """A step's prompts (``jobs``: the asking replicas' windows) into their queues;
        ``requests[asker]``: its request (P, urgent); ``sharing[asker]``: how many engines share
        the replica's queue."""
        for chunk, prompts, settings in jobs:
            if dataclasses.replace(settings, seed=None) != dataclasses.replace(self.settings, seed=None):
                raise ValueError(f"streaming rollouts sample every step alike; trainer rank {chunk.dest} asked with "
                                 f"{settings}, the stream runs {self.settings}")
            request = requests[chunk.dest]
            replica = self.replicas.get(chunk.dest)
            if replica is None:
                replica = self.replicas[chunk.dest] = _Replica(
                    chunk.dest, dataclasses.replace(chunk, index=STREAMED), self.generator.version, request.want,
                    _Queue(f"stream/{chunk.dest}/steps"), _Queue(f"stream/{chunk.dest}/urgent"))
                shared = sharing.get(chunk.dest, 1) > 1 and self.shared is not None
                self.claims[chunk.dest] = self.shared if shared else self.local
            queue = replica.urgent if request.urgent else replica.steps
            queue.entries += [(ticket, (position, index, list(ids), settings.skip(i).seed or 0))
                              for i, (position, index, ids) in enumerate(prompts)]
        self._blocked = None

    @property
    def busy(self) -> bool:
        """Samples are running, or a queued prompt could start now."""
        return self.generator.num_running_samples > 0 or self._admissible()

    def _state(self) -> tuple:
        g = self.generator
        return g.num_running_samples, g.reserved_kv_tokens, g.version

    def _admissible(self) -> bool:
        if self._blocked == self._state():
            return False
        if any(self._next(replica) is not None for replica in self.replicas.values()):
            return True
        self._blocked = self._state()
        return False

    def _next(self, replica: _Replica):
        """The replica's next admissible entry ``(queue, index, ticket, entry, trained)`` that
        this engine may claim now, or None: its urgent queue first."""
        claims = self.claims[replica.dest]
        for queue in (replica.urgent, replica.steps):
            index = claims.first(queue.name)
            got = queue.entry(index)
            if got is None:
                continue
            ticket, entry = got
            trained = self.generator.version if queue is replica.urgent else \
                replica.base_version + index // max(1, replica.want)
            if self.generator.refusal(len(entry[2]), trained) is None:
                return queue, index, ticket, entry, trained
            return None  # the urgent queue's refused entry is not overtaken by the steps'
        return None

    def admit(self) -> int:
        """Claim and admit queued groups, one replica's at a time in turn, while the generator
        allows; returns how many."""
        admitted, progress = 0, self._blocked != self._state()
        while progress:
            progress = False
            for replica in self.replicas.values():
                nxt = self._next(replica)
                if nxt is None:
                    continue
                queue, index, ticket, (position, training_index, ids, seed), trained = nxt
                progress = True
                if not self.claims[replica.dest].claim(queue.name, index):
                    continue  # another engine has it: look again
                urgent = ticket if queue is replica.urgent else -1
                assert self.generator.admit(ids, seed, trained, key=(replica.dest, position, training_index, index,
                                                                     urgent))
                replica.running += 1
                admitted += 1
        self._blocked = self._state()  # nothing more can start before the generator's state changes
        return admitted

    def advance(self, post: Post) -> None:
        """Admit what may start, run one decode iteration, and post the groups it completed."""
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
        """New weights (a streamed transfer) as ``version``, in ``rollout.streaming.weight_load``'s mode."""
        self.generator.load_weights(named_tensors, version, self.mode)
        self._blocked = None

    def abort(self) -> int:
        """Drop every running request (a stop); returns how many."""
        return self.generator.abort()

    def _iterate(self, post: Post) -> None:
        started = time.perf_counter()
        self.generator.step()
        self.stepping += time.perf_counter() - started
        for group in self.generator.take():
            dest, position, training_index, index, urgent = group.key
            replica = self.replicas[dest]
            replica.running -= 1
            reply = dict(group=Group(training_index, group.prompt_token_ids, group.samples), position=position,
                         index=index, urgent=urgent >= 0, running=replica.running, waiting=len(replica.steps))
            post(urgent if urgent >= 0 else 0, replica.chunk, [reply], self.stepping)
            self.stepping = 0.0
