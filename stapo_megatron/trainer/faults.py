"""Which rank failed first: failure records in the run directory and the message built from them.

When one rank of a job fails, every other rank fails soon after with a communication error
("Connection closed by peer", a store timeout) that says nothing about the cause, and under
torchrun each node reports its own ranks' errors. So every rank that fails leaves a record,
``<run_dir>/failures/rank_00003.json``, before its process group is torn down (which is when
the peers notice); a rank whose failure is such a communication error re-raises it as a
`PeerFailure` whose message names the rank that failed first:

* a rank that recorded an error of its own (not a communication error) failed first
  (the earliest such record);
* otherwise the ranks that left no record: a rank killed by a signal (out of memory, a
  ``kill -9``, a lost node) cannot write one.

torchrun prints the message of a rank's last exception as that node's root cause when the
worker's entry function is decorated with torch's ``@record`` (``launch/entry.py``). Records
belong to one launch: a rank removes its own stale record when it starts, and a record of
another launch (torchrun's ``TORCHELASTIC_RUN_ID`` and restart count) is ignored.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Dict, List

import torch.distributed as dist

FAILURES_DIR = "failures"
"""Subdirectory of the run directory holding one JSON record per failed rank."""

_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""gloo's messages when a peer process has gone (a plain RuntimeError, not a DistError)."""


class PeerFailure(RuntimeError):
    """This rank stopped because another rank failed; the message names the one that failed first."""


def _launch_id() -> str:
    """Tells this launch's records from an earlier launch's (same id on every node)."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _rank() -> int:
    """The global rank: torchrun's ``RANK`` (set before any process group exists, and equal to
    the group's rank after), else the default group's, else 0."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"])
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return dist.get_world_size() if dist.is_initialized() else 1


def record_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, FAILURES_DIR, f"rank_{rank:05d}.json")


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is what a rank sees when another rank failed: a torch.distributed
    error (store timeout, NCCL abort) or gloo's lost connection."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(text in str(error) for text in _PEER_LOST))


def clear_record(run_dir: str) -> None:
    """Remove this rank's record of an earlier launch (call when the rank starts)."""
    try:
        os.remove(record_path(run_dir, _rank()))
    except FileNotFoundError:
        pass


def write_record(run_dir: str, error: BaseException) -> Dict:
    """Record ``error`` as this rank's failure (atomically: a reader never sees half a record)."""
    record = dict(rank=_rank(), host=socket.gethostname(), pid=os.getpid(), time=time.time(),
                  launch=_launch_id(), peer_failure=is_peer_failure(error),
                  error=f"{type(error).__name__}: {error}".strip())
    path = record_path(run_dir, record["rank"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    return record


def read_records(run_dir: str) -> List[Dict]:
    """This launch's failure records, earliest first."""
    folder = os.path.join(run_dir, FAILURES_DIR)
    records = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith("rank_") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                record = json.load(f)
            if record.get("launch") == _launch_id():
                records.append(record)
    return sorted(records, key=lambda r: r["time"])


def first_failure(records: List[Dict], world_size: int) -> str:
    """The sentence naming the rank that failed first, from this launch's ``records``."""
    own = [r for r in records if not r["peer_failure"]]
    if own:
        r = own[0]
        when = time.strftime("%H:%M:%S", time.localtime(r["time"]))
        return f"rank {r['rank']} failed first ({r['host']}, {when}): {r['error']}"
    silent = sorted(set(range(world_size)) - {r["rank"] for r in records})
    if len(silent) == 1:
        return (f"rank {silent[0]} failed first: it ended without a failure record, so it was killed "
                "(a signal, the out-of-memory killer, or its node was lost); its node's torchrun "
                "summary has its exit code")
    if silent:
        return (f"no rank recorded an error of its own; ranks without a record (killed, or not "
                f"failed yet): {silent}")
    return "every rank recorded only a lost connection (see each rank's record)"


def failed(run_dir: str, error: BaseException) -> BaseException:
    """Record this rank's failure; what to raise: ``error``, or a `PeerFailure` naming the rank
    that failed first when ``error`` only says that a peer went away.

    Call before tearing the process group down: the peers notice this rank's failure when its
    connections close, and then read this record. An error already passed here (by an inner
    caller) is returned as it is.
    """
    if getattr(error, "failure_recorded", False):
        return error
    record = write_record(run_dir, error)
    error.failure_recorded = True
    if not record["peer_failure"]:
        return error
    cause = first_failure(read_records(run_dir), _world_size())
    failure = PeerFailure(f"rank {record['rank']} stopped because another rank failed: {cause}. "
                          f"This rank's own error: {record['error'][:300]} "
                          f"(records: {os.path.join(run_dir, FAILURES_DIR)})")
    failure.__cause__ = error
    failure.failure_recorded = True
    return failure
