"""Time-bounded batch scoring of responses: `RewardScorer`, a pool of spawned worker processes.

Runs a reward function (``(response, answer) -> (reward, status)``, `stapo_megatron.rewards.functions`)
on many items at once, each under a CPU-time limit: a worker that exceeds it is killed and
replaced, and the item scores the reward's failure value. This works from any thread, where
math-verify's own ``signal.alarm`` timeouts do not (`stapo_megatron.rewards.answers`).
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.connection
import threading
import time
from typing import Callable, Optional

import psutil

from stapo_megatron.rewards.answers import STATUS_BAD_ANSWER, STATUS_UNPARSEABLE, score_response

# Time a spawned worker may take to import math-verify/sympy and warm up on a busy machine.
# Limits are counted in the worker's CPU seconds, not wall-clock: on a loaded machine a worker
# waits for a core, and a wall-clock limit would then score correct answers 0 (and make a run's
# rewards depend on machine load). A pathological parse burns CPU and is still cut at the limit.
# Importing math-verify/sympy takes a few CPU seconds; the wall-clock backstops only catch a
# worker that is blocked without using CPU at all.
_STARTUP_CPU_S = 120.0
_STARTUP_WALL_S = 1800.0
_ITEM_WALL_FACTOR = 60.0


def _worker_main(conn, score_fn: Callable[[str, str], tuple[float, str]]) -> None:
    """Worker process loop: warm up, say ready, then score (response, answer) items until None."""
    try:
        # Imports and parser caches warm up before the first timed item.
        score_fn("\\boxed{1}", "1")
    except Exception as e:  # reported to the parent, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        item = conn.recv()
        if item is None:
            return
        try:
            conn.send(("ok", score_fn(*item)))
        except Exception as e:  # one bad item must not take the worker down
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    """One spawned scoring process and the item it is working on."""

    def __init__(self, ctx, score_fn) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child_conn, score_fn), daemon=True)
        self.process.start()
        child_conn.close()
        self.ready = False
        self.item: Optional[int] = None
        self.start_clock()

    def cpu_seconds(self) -> float:
        """CPU time the worker process has used so far (0 once it has exited)."""
        try:
            times = psutil.Process(self.process.pid).cpu_times()
        except psutil.Error:
            return 0.0
        return times.user + times.system

    def start_clock(self) -> None:
        self.since, self.cpu_since = time.monotonic(), self.cpu_seconds()

    def overran(self, cpu_limit: float, wall_limit: float) -> bool:
        return (self.cpu_seconds() - self.cpu_since >= cpu_limit
                or time.monotonic() - self.since >= wall_limit)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardScorer:
    """Time-bounded batch scoring in a pool of spawned processes; usable from any thread.

    Each item is sent to an idle worker on its own and gets ``timeout_s`` seconds of the worker's
    CPU time from the moment it is sent (so machine load does not change rewards), with a
    wall-clock backstop of 60 x ``timeout_s`` for a worker blocked without using CPU; a worker that overruns is killed (SIGKILL) and replaced, and the item scores ``failure_reward`` and
    is counted in ``num_timeouts``. Workers start lazily on the first ``score`` call and are kept
    for later calls. ``score`` calls from several threads are serialised.

    Workers use the ``spawn`` start method (fork would copy the trainer's threads in an undefined
    state). As with any spawn pool, each worker imports the parent's main module without running
    its ``if __name__ == "__main__":`` block, so the entry script must be import-safe, and its
    top-level imports are paid once per worker start; call ``start()`` early to overlap that with
    other set-up. Use as a context manager, or call ``close()``.
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 5.0,
                 score_fn: Callable[[str, str], tuple[float, str]] = score_response,
                 failure_reward: float = 0.0) -> None:
        """
        Args:
            num_workers: number of worker processes.
            timeout_s: per-item time limit in seconds.
            score_fn: a picklable module-level function ``(response, answer) -> (reward, status)``
                run in the workers; ``score_response`` by default (``stapo_megatron.rewards.functions``
                names the others).
            failure_reward: the reward of an item that timed out or whose scoring raised (0 for
                a 1/0 reward, -1 for the paper's +1/-1 reward).
        """
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._score_fn = score_fn
        self.failure_reward = float(failure_reward)
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Launch the workers now without waiting for them (``score`` would do it lazily)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardScorer.start() called after close()")
            self._fill_pool()

    def score(self, responses: list[str], answers: list[str]) -> tuple[list[float], dict]:
        """Score responses against reference answers.

        Args:
            responses: model responses.
            answers: the reference answer of each response (same length).

        Returns:
            (rewards in input order, stats) where stats has ``num_timeouts`` (killed after
            ``timeout_s``), ``num_unparseable`` (no final box, or math-verify cannot parse it),
            ``num_bad_answers`` (reference answer unparseable) and ``num_errors`` (the scoring
            function raised or its worker died); timeouts and errors score ``failure_reward``,
            the others what the scoring function gave them.

        Raises:
            ValueError: if the lengths differ. RuntimeError: if a worker cannot start, or after close().
        """
        if len(responses) != len(answers):
            raise ValueError(f"got {len(responses)} responses but {len(answers)} answers")
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardScorer.score() called after close()")
            return self._score_locked(list(zip(responses, answers)))

    def _score_locked(self, items: list[tuple[str, str]]) -> tuple[list[float], dict]:
        rewards = [self.failure_reward] * len(items)
        stats = {"num_timeouts": 0, "num_unparseable": 0, "num_bad_answers": 0, "num_errors": 0}
        if not items:
            return rewards, stats
        todo = collections.deque(range(len(items)))
        while True:
            self._fill_pool()  # replaces workers killed on timeout
            for worker in self._workers:
                if worker.ready and worker.item is None and todo:
                    worker.item = todo.popleft()
                    worker.start_clock()
                    worker.conn.send(items[worker.item])
            if not todo and all(w.item is None for w in self._workers):
                break
            self._wait_and_collect(rewards, stats)
        return rewards, stats

    def _fill_pool(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self._score_fn))

    def _wait_and_collect(self, rewards: list[float], stats: dict) -> None:
        """Wait for the next message or a poll tick; record results, kill and drop overrunning workers.

        Overrun is checked every ``min(timeout_s, 1 s) / 4`` of wall time against the worker's
        CPU time (see ``_STARTUP_CPU_S``).
        """
        waiting = [w for w in self._workers if not w.ready or w.item is not None]
        poll = min(self.timeout_s, 1.0) / 4
        ready_conns = multiprocessing.connection.wait([w.conn for w in waiting], timeout=poll)
        for worker in waiting:
            if worker.conn in ready_conns:
                self._receive(worker, rewards, stats)
            elif not worker.ready:
                if worker.overran(_STARTUP_CPU_S, _STARTUP_WALL_S):
                    self._drop(worker)
                    raise RuntimeError(f"reward worker did not start within {_STARTUP_CPU_S:.0f} CPU seconds "
                                       f"({_STARTUP_WALL_S:.0f} s wall-clock backstop)")
            elif worker.overran(self.timeout_s, self.timeout_s * _ITEM_WALL_FACTOR):
                stats["num_timeouts"] += 1
                self._drop(worker)

    def _receive(self, worker: _Worker, rewards: list[float], stats: dict) -> None:
        try:
            kind, payload = worker.conn.recv()
        except (EOFError, OSError):
            kind, payload = "died", f"exit code {worker.process.exitcode}"
        if not worker.ready:
            if kind != "ready":
                self._drop(worker)
                raise RuntimeError(f"reward worker failed to start: {payload}")
            worker.ready = True
            return
        if kind == "ok":
            reward, status = payload
            rewards[worker.item] = float(reward)
            if status == STATUS_UNPARSEABLE:
                stats["num_unparseable"] += 1
            elif status == STATUS_BAD_ANSWER:
                stats["num_bad_answers"] += 1
            worker.item = None
            return
        stats["num_errors"] += 1
        if kind == "died":
            self._drop(worker)
        else:
            worker.item = None

    def _drop(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.remove(worker)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        with self._lock:
            self._closed = True
            for worker in self._workers:
                try:
                    worker.conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            for worker in self._workers:
                worker.process.join(timeout=5.0)
                worker.kill()
            self._workers = []

    def __enter__(self) -> "RewardScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
