"""Run a function on N gloo processes (tier-b tests) and collect each rank's return value; or on N
threads of this process (`rank_threads`: ranks that share one store, as the transport's tests do)."""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import traceback

import torch.multiprocessing as mp

from stapo_megatron.utils import free_port, local_rank_env


@contextlib.contextmanager
def single_process_env():
    """torch.distributed's environment for a one-rank group in this process; restored on exit."""
    env = local_rank_env(0, 1, free_port())
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@contextlib.contextmanager
def one_rank_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1):
    """This process as a one-rank Megatron job (`single_process_env`, then `init_parallel`):
    yields its `Groups`; the parallel state and the default process group are destroyed on exit,
    also when the block (or ``init_parallel`` half-way) raises, so no later test finds them."""
    from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel

    with single_process_env():
        try:
            yield init_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
        finally:
            destroy_parallel()


def kill_marked(marker: str, variable: str = "STAPO_TEST_LAUNCH") -> None:
    """Kill every process whose environment has ``variable=marker``: what a launch left behind
    (a rank SIGKILLed in a test orphans the helper processes it had spawned, which never exit)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.environ().get(variable) == marker:
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass


def _worker(rank, world_size, port, fn, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch

    torch.set_num_threads(1)
    try:
        # plain pickle: tensors travel by value, not as shared-memory handles that die with
        # the child process
        queue.put((rank, "ok", pickle.dumps(fn(*args))))
    except BaseException:  # report the child's traceback to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(world_size: int, fn, *args, timeout: float = 600.0) -> list:
    """Spawn ``world_size`` processes running ``fn(*args)``; return results ordered by rank.

    ``fn`` must be importable (module level) and return picklable values. It initialises
    torch.distributed itself (from the RANK/WORLD_SIZE/MASTER_* environment, as torchrun sets).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, value = queue.get(timeout=timeout)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("distributed worker failed\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]


def rank_threads(fn, world_size: int, timeout: float = 300.0) -> dict:
    """``fn(rank)`` on ``world_size`` threads of this process; {rank: its return value}. The first
    rank's exception is raised here once every thread has ended (or ``timeout`` seconds each)."""
    results, errors = {}, []

    def main(rank):
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # noqa: BLE001  (re-raised below)
            errors.append(error)

    threads = [threading.Thread(target=main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if errors:
        raise errors[0]
    return results
