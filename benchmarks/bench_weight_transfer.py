"""Separate placement's weight transfer: seconds per GB from trainer 0 to the engines, and the
engine's peak staging memory, through the real code (`RemoteEngine.update_weights` on one side,
`stapo_megatron.rollout.weight_receive.receive_weights` on the engine's main thread on the
other, each tensor copied into the engine's "parameters" as vLLM's ``load_weights`` would), per
bucket size.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=. .venv/bin/python benchmarks/bench_weight_transfer.py \
        [--gb 1.0] [--engines 1] [--buckets 64,256,1024] [--repeats 3]

Starts 1 + ``--engines`` processes on this machine (gloo over loopback TCP, CPU tensors: the trainers'
NCCL path needs a GPU per process, two at least, which the lent one-GPU machine does not have)
joined by a TCP store; trainer 0 streams ``--gb`` of bf16 tensors of
a 4096-wide layer's shapes. A transfer's time runs from the call until every engine holds the
whole set (a barrier after). Prints one row per bucket size: the median seconds per GB, the
GB/s, and the engine's peak staging memory: its peak resident memory during the transfer over
its resident memory before (Linux ``VmHWM``, reset at each transfer), the largest of the
repeats, with the parameters allocated and touched before; beside it the bound, the two largest
consecutive buckets (a 7B layer's gate+up matrix, 172 MiB, is larger than a 64 MiB bucket and
travels alone). On a GPU the same buffers are on the engine's GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
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


def _two_buckets_mib(tensors, bucket_mb: int) -> float:
    """The largest sum of two consecutive buckets `RemoteEngine.update_weights` makes of
    ``tensors`` (a tensor larger than the bucket travels alone): the bound on the staging."""
    sizes, size = [], 0
    for _, t in tensors:
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > bucket_mb * 2**20:
            sizes.append(size)
            size = 0
        size += nbytes
    sizes.append(size)
    return max(a + b for a, b in zip(sizes, sizes[1:] + [0])) / 2**20


def _peak_staging_mib(receive, targets) -> float:
    """Copy a transfer into ``targets``; the engine process's peak resident memory over its
    resident memory before, in MiB."""
    def status(field: str) -> float:
        return int(re.search(rf"{field}:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024

    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident memory
    for name, tensor in receive:
        targets[name].copy_(tensor)
    return status("VmHWM") - before


def _rank(rank: int, world: int, port: int, args, results) -> None:
    from stapo_megatron.rollout.transport import broadcast_object, connect
    from stapo_megatron.rollout.remote import RemoteEngine
    from stapo_megatron.rollout.weight_receive import receive_weights

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    transport = connect(store, rank, world, args.engines, 1, samples_timeout_s=600)
    tensors, total = _tensors(args.gb)
    targets = {name: torch.zeros_like(t) for name, t in tensors} if rank > 0 else None  # touched: resident before
    if rank > 0:
        del tensors  # an engine holds only its parameters
    rows = []
    for bucket_mb in args.buckets:
        times, peaks = [], []
        for _ in range(args.repeats):
            transport.data.barrier().wait()
            start = time.perf_counter()
            if rank == 0:
                RemoteEngine(transport, True, 600, bucket_mb).update_weights(iter(tensors))
            else:
                command = broadcast_object(transport.control)
                assert command[0] == "weights", command
                peaks.append(_peak_staging_mib(receive_weights(transport, torch.device("cpu")), targets))
            transport.data.barrier().wait()  # every engine holds the whole set
            times.append(time.perf_counter() - start)
        if rank == 1:
            results.put(("peak", bucket_mb, max(peaks)))
        rows.append((bucket_mb, statistics.median(times)))
    if rank == 0:
        results.put((total, [(b, t, _two_buckets_mib(tensors, b)) for b, t in rows]))
        RemoteEngine(transport, True, 600, 1).shutdown()
    else:
        assert broadcast_object(transport.control)[0] == "stop"


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
    got = [results.get(timeout=3600) for _ in range(1 + len(args.buckets))]
    peaks = {bucket_mb: mib for kind, bucket_mb, mib in (g for g in got if g[0] == "peak")}
    total, rows = next(g for g in got if g[0] != "peak")
    for p in procs:
        p.join(timeout=60)
    device = f"CPU ({os.cpu_count()} cores), gloo"
    print(f"weight transfer, {total / 1e9:.2f} GB bf16, trainer 0 -> {args.engines} engine(s), {device}, "
          f"median of {args.repeats}")
    print(f"| bucket (MiB) | s per GB | GB/s | engine peak staging (MiB) | two largest consecutive buckets (MiB) | "
          f"model (MiB) |")
    print("|---|---|---|---|---|---|")
    for bucket_mb, seconds, two_mib in rows:
        print(f"| {bucket_mb} | {seconds / (total / 1e9):.3f} | {total / 1e9 / seconds:.2f} | {peaks[bucket_mb]:.0f} | "
              f"{two_mib:.0f} | {total / 2**20:.0f} |")

if __name__ == "__main__":
    main()
