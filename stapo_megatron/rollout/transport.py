"""Separate placement's processes: which ranks of the job train and which generate, and the
process groups between them (`Transport`); the object and tensor messages that cross them.

One torchrun (or srun + torchrun) job, nothing else started: of its W ranks the first T = W - E
train and the last E = ``rollout.separate.engine_ranks`` run engines (`stapo_megatron.serve.server`).
`init_job` reads torchrun's store and forms

* the default process group of each side: the T trainers (Megatron's world: its groups never
  see an engine) or the E engines (vLLM's external launcher forms its TP groups in it);
* ``data``: all W ranks (gloo): the samples, from an engine to the trainers that asked;
* ``control``: trainer 0 and the E engines (gloo): trainer 0's commands, in one order every
  engine executes (`stapo_megatron.serve.server`), and the weight buckets' manifests;
* ``weights``: the same ranks (NCCL between GPUs, gloo on the CPU): the weight buckets;

and keeps a view of the store (``Transport.store``) in which the engines that share a replica's
streaming admission queue claim its groups (`stapo_megatron.serve.stream_pools`).

These groups are not registered with ``torch.distributed`` (each side's default group is its
own); they are used through their own ``send``/``recv``/``broadcast`` (as vLLM's stateless
process groups are). A rank that dies closes its connections and its peers' next operation on
them raises at once; a silent peer is caught by the groups' timeouts.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

ENGINE_WAIT_S = 24 * 3600.0
"""How long an engine waits for trainer 0's next command: a whole training step, at the paper's
lengths possibly long; a trainer that dies is noticed at once (its connections close) and a hung
one by the trainers' own collective timeouts, which end them."""

SAMPLES_TAG, HEADER_TAG = 11, 12
"""Tags of the sample messages on ``data`` (a header, then the pickled payload)."""


@dataclasses.dataclass
class Transport:
    """This rank's place in a separately placed job and the groups that cross the two pools."""

    rank: int
    """Global rank in the job (torchrun's ``RANK``)."""
    trainers: int
    """T: ranks 0 .. T-1 train."""
    engine_ranks: int
    """E: ranks T .. T+E-1 run engines."""
    engine_tp: int
    """Ranks per engine (vLLM's TP); engine i is ranks T + i x engine_tp, ...; its first sends."""
    data: Any
    """All ranks (gloo): samples."""
    control: Optional[Any] = None
    """Trainer 0 (its rank 0) and the engines (rank 1 + e): commands. None on trainers 1 .. T-1."""
    weights: Optional[Any] = None
    """The same ranks as ``control``: weight buckets (NCCL on GPUs). None where ``control`` is."""
    store: Optional[Any] = None
    """The job's store under its own prefix (engines): the streaming admission queues' claims."""

    @property
    def is_engine(self) -> bool:
        return self.rank >= self.trainers

    @property
    def num_engines(self) -> int:
        return self.engine_ranks // self.engine_tp

    def engine_leader(self, engine: int) -> int:
        """Global rank of engine ``engine``'s first rank (the one that sends its samples)."""
        return self.trainers + engine * self.engine_tp

    @property
    def engine_index(self) -> int:
        """This engine rank's engine."""
        return (self.rank - self.trainers) // self.engine_tp

    @property
    def is_engine_leader(self) -> bool:
        return self.is_engine and (self.rank - self.trainers) % self.engine_tp == 0


def _group(store, prefix: str, rank: int, size: int, timeout_s: float, backend: str):
    """A process group over ``store`` under ``prefix``, not registered with torch.distributed."""
    store = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def init_job(engine_ranks: int, engine_tp: int, init_timeout_s: float, timeout_s: float,
             samples_timeout_s: float) -> Transport:
    """Split torchrun's job into trainers and engines (module docstring) and form the groups.

    Args:
        engine_ranks, engine_tp: ``rollout.separate.engine_ranks``, ``rollout.tensor_parallel_size``.
        init_timeout_s: how long a rank waits for the others to join (``init_timeout_s``).
        timeout_s: the default groups' collective timeout (``distributed_timeout_s``).
        samples_timeout_s: how long a trainer waits for an engine's samples (the rollout timeout).
    Raises:
        ValueError: the job has no rank left to train.
    """
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=init_timeout_s)))
    trainers = world - engine_ranks
    if trainers < 1:
        raise ValueError(f"rollout.separate.engine_ranks={engine_ranks} leaves no training rank of the job's {world}")
    on_gpu = torch.cuda.is_available()
    backend = "nccl" if on_gpu else "gloo"
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    engine = rank >= trainers
    side, side_rank, side_size = ("engines", rank - trainers, engine_ranks) if engine else ("trainers", rank, trainers)
    dist.init_process_group(backend, store=dist.PrefixStore(side, store), rank=side_rank, world_size=side_size,
                            timeout=datetime.timedelta(seconds=init_timeout_s))
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    return connect(store, rank, world, engine_ranks, engine_tp, samples_timeout_s, backend)


def connect(store, rank: int, world: int, engine_ranks: int, engine_tp: int, samples_timeout_s: float,
            weights_backend: str = "gloo") -> Transport:
    """This rank's `Transport`: the groups that cross the two pools, formed over ``store`` (every rank
    of the job calls it; the trainers other than 0 join ``data`` only)."""
    trainers = world - engine_ranks
    transport = Transport(rank, trainers, engine_ranks, engine_tp,
                          data=_group(store, "transport/data", rank, world, samples_timeout_s, "gloo"))
    if rank == 0 or rank >= trainers:
        member = 0 if rank == 0 else 1 + rank - trainers
        transport.control = _group(store, "transport/control", member, engine_ranks + 1, ENGINE_WAIT_S, "gloo")
        transport.weights = _group(store, "transport/weights", member, engine_ranks + 1, ENGINE_WAIT_S, weights_backend)
    if rank >= trainers:
        transport.store = dist.PrefixStore("transport/queue", store)
    return transport


def _wait(work, timeout_s: Optional[float]) -> None:
    if timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))


def broadcast_tensor(group, tensor: torch.Tensor, timeout_s: Optional[float] = None) -> torch.Tensor:
    """Broadcast ``tensor`` from the group's rank 0 into every member's ``tensor`` (in place)."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    _wait(group.broadcast([tensor], options), timeout_s)
    return tensor


def broadcast_object(group, obj: Any = None, timeout_s: Optional[float] = None) -> Any:
    """``obj`` of the group's rank 0, on every member (pickled: a length, then the bytes)."""
    payload = _to_bytes(obj) if group.rank() == 0 else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    broadcast_tensor(group, size, timeout_s)
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    return pickle.loads(broadcast_tensor(group, payload, timeout_s).numpy().tobytes())


def _to_bytes(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


class Outbox:
    """An engine's sends of samples: posted without waiting (the engine goes on generating), their
    buffers kept until the trainer has taken them."""

    def __init__(self, group):
        self.group = group
        self.pending: List[Tuple[Any, Tuple[torch.Tensor, ...]]] = []

    def send(self, dst: int, header: List[int], obj: Any) -> None:
        """Post ``header`` (ints, the payload's byte count appended) and ``obj`` to rank ``dst``."""
        payload = _to_bytes(obj)
        head = torch.tensor([*header, payload.numel()], dtype=torch.int64)
        works = [self.group.send([head], dst, HEADER_TAG), self.group.send([payload], dst, SAMPLES_TAG)]
        self.pending += [(w, (head, payload)) for w in works]
        self.pending = [(w, kept) for w, kept in self.pending if not w.is_completed()]

    def close(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s`` each) for the sends still in flight."""
        for work, _ in self.pending:
            _wait(work, timeout_s)
        self.pending = []


def receive(group, src: int, header_len: int, timeout_s: Optional[float]) -> Tuple[List[int], Any]:
    """The next ``(header, object)`` that rank ``src`` sent this rank with `Outbox.send`."""
    head = torch.empty(header_len + 1, dtype=torch.int64)
    _wait(group.recv([head], src, HEADER_TAG), timeout_s)
    payload = torch.empty(int(head[-1]), dtype=torch.uint8)
    _wait(group.recv([payload], src, SAMPLES_TAG), timeout_s)
    return head[:-1].tolist(), pickle.loads(payload.numpy().tobytes())


def receive_any(group, header_len: int, timeout_s: Optional[float]) -> Tuple[int, List[int], Any]:
    """The next ``(source rank, header, object)`` that any rank sent this rank with `Outbox.send`
    (the header from whichever rank sent first, then that rank's payload)."""
    head = torch.empty(header_len + 1, dtype=torch.int64)
    work = group.recv_anysource([head], HEADER_TAG)
    _wait(work, timeout_s)
    src = work._source_rank()
    payload = torch.empty(int(head[-1]), dtype=torch.uint8)
    _wait(group.recv([payload], src, SAMPLES_TAG), timeout_s)
    return src, head[:-1].tolist(), pickle.loads(payload.numpy().tobytes())
