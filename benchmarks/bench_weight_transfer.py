"""Separate placement's weight transfer: seconds per GB from trainer 0 to the engines, through the
real code (`RemoteEngine.update_weights` on one side, the engine's listener thread,
`stapo_megatron.trainer.engine_server._listen`, on the other), per bucket size.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=. .venv/bin/python benchmarks/bench_weight_transfer.py \
        [--gb 1.0] [--engines 1] [--buckets 64,256,1024] [--repeats 3]

Starts 1 + ``--engines`` processes on this machine (gloo over loopback TCP, CPU tensors: the trainers'
NCCL path needs a GPU per process, two at least, which the lent one-GPU machine does not have)
joined by a TCP store; trainer 0 streams ``--gb`` of bf16 tensors of
a 4096-wide layer's shapes. A transfer's time runs from the call until every engine holds the
whole set (a barrier after). Prints one row per bucket size: the median seconds per GB and the
GB/s, and the engine's staged copy's size (what separate placement costs an engine's host).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from malloc_check import check_jemalloc  # benchmarks/, the script's folder

SHAPES = [(4096 * 3, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]
"""A decoder layer's matrices (QKV, O, gate+up, down) of a 7B-class model, cycled to fill ``--gb``."""


def _tensors(gb: float):
    out, total, i = [], 0, 0
    while total < gb * 1e9:
        shape = SHAPES[i % len(SHAPES)]
        t = torch.randn(shape, dtype=torch.bfloat16)
        out.append((f"layers.{i // len(SHAPES)}.w{i % len(SHAPES)}", t))
        total += t.numel() * t.element_size()
        i += 1
    return out, total


def _rank(rank: int, world: int, port: int, args, results) -> None:
    from stapo_megatron.rollout.transport import connect
    from stapo_megatron.rollout.remote import RemoteEngine
    from stapo_megatron.trainer.engine_server import _listen

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    transport = connect(store, rank, world, args.engines, 1, samples_timeout_s=600)
    tensors, total = _tensors(args.gb) if rank == 0 else (None, 0)
    inbox, stopping = queue.Queue(), threading.Event()
    if rank > 0:
        threading.Thread(target=_listen, args=(transport, inbox, stopping), daemon=True).start()
    rows = []
    for bucket_mb in args.buckets:
        times = []
        for _ in range(args.repeats):
            transport.data.barrier().wait()
            start = time.perf_counter()
            if rank == 0:
                RemoteEngine(transport, True, 600, bucket_mb).update_weights(iter(tensors))
            else:
                command = inbox.get()
                assert command[0] == "weights", command
            transport.data.barrier().wait()  # every engine holds the whole set
            times.append(time.perf_counter() - start)
        rows.append((bucket_mb, statistics.median(times)))
    if rank == 0:
        results.put((total, rows))
        RemoteEngine(transport, True, 600, 1).shutdown()
    else:
        assert inbox.get()[0] == "stop"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    check_jemalloc()  # the CPU copies into and out of the buckets
    from tests.helpers.dist_utils import _free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world, port = 1 + args.engines, _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    total, rows = results.get(timeout=3600)
    for p in procs:
        p.join(timeout=60)
    device = f"CPU ({os.cpu_count()} cores), gloo"
    print(f"weight transfer, {total / 1e9:.2f} GB bf16, trainer 0 -> {args.engines} engine(s), {device}, "
          f"median of {args.repeats}")
    print("| bucket (MiB) | s per GB | GB/s |")
    print("|---|---|---|")
    for bucket_mb, seconds in rows:
        print(f"| {bucket_mb} | {seconds / (total / 1e9):.3f} | {total / 1e9 / seconds:.2f} |")


if __name__ == "__main__":
    main()
