"""The doctor's collectives row: all-reduce and all-gather over the node's GPUs (NCCL) or two
CPU processes (gloo), correct and at what bus bandwidth, against the hardware's nominal figure.

Bus bandwidth as nccl-tests defines it (``doc/PERFORMANCE.md`` of NVIDIA/nccl-tests), so the
numbers compare with published ones: for ``n`` ranks and a message of ``S`` bytes taking ``t``,

    all-reduce   busbw = S / t * 2 (n - 1) / n
    all-gather   busbw = S / t * (n - 1) / n        (S: the gathered, whole output)

Launched by torchrun over one or two nodes (``launch/doctor.py``) the ranks are the job's, so
the figure is the inter-node one when the job spans nodes; otherwise this process spawns one
rank per local GPU (two gloo ranks on a CPU machine).
"""

from __future__ import annotations

import os
import time
from typing import Dict, Optional

import torch
import torch.distributed as dist

from stapo_megatron.doctor.report import Check, failed, passed, skipped
from stapo_megatron.utils import free_port

NOMINAL_NVLINK_GBPS = {"H100": 450.0, "H200": 450.0, "H20": 450.0, "B200": 900.0, "GB200": 900.0, "A100": 300.0}
"""Per-GPU NVLink bandwidth in one direction, GB/s (NVIDIA's data sheets: NVLink 4 900 GB/s and
NVLink 5 1.8 TB/s both directions, A100 NVLink 3 600 GB/s), matched against the device name."""

HEALTHY_FRACTION = 0.5
"""A node passes at >= this fraction of the nominal figure. A loose bound on purpose (no H100 run
of this row yet to set a tighter one): what it catches is traffic off NVLink, a missing
NVLink/NVSwitch path (PCIe Gen5 x16 is ~64 GB/s, a seventh of NVLink 4) or a misconfigured NCCL
(NCCL_P2P_DISABLE set)."""

MESSAGE_BYTES = {"cuda": 256 * 2**20, "cpu": 2**20}
"""Message size per collective: large enough for the bandwidth plateau on NVLink (nccl-tests
collectives are bandwidth-bound well below it), small enough for a shared CPU machine."""


def nominal_gbps(device_name: str) -> Optional[float]:
    """The nominal per-GPU NVLink bandwidth for a device name, or None when unknown."""
    for key in sorted(NOMINAL_NVLINK_GBPS, key=len, reverse=True):
        if key in device_name:
            return NOMINAL_NVLINK_GBPS[key]
    return None


# torch >= 2.13 renames all_gather_into_tensor (same arguments) and warns on the old name
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up (a barrier before each, CUDA synchronised)."""
    fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure(repeats: int = 5) -> Dict[str, float]:
    """On every rank of the formed default group: check both collectives' results and time them.

    Returns (the same on every rank, the slowest rank's time) ``all_reduce_busbw_gbps``,
    ``all_gather_busbw_gbps``, ``ranks``; raises ValueError on a wrong result.
    """
    n, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    numel = MESSAGE_BYTES[device.type] // 4
    x = torch.full((numel,), float(rank + 1), device=device)
    dist.all_reduce(x)
    if not bool((x == n * (n + 1) / 2).all()):  # small integers: exact in fp32
        raise ValueError(f"all_reduce over {n} ranks returned a wrong sum on rank {rank}")
    shard = torch.full((numel // n,), float(rank), device=device)
    out = torch.empty(numel // n * n, device=device)
    _all_gather(out, shard)
    if not torch.equal(out.view(n, -1)[:, 0].cpu(), torch.arange(n, dtype=torch.float32)):
        raise ValueError(f"all_gather over {n} ranks returned shards out of order on rank {rank}")
    t_reduce = _timed(lambda: dist.all_reduce(x), device, repeats)
    t_gather = _timed(lambda: _all_gather(out, shard), device, repeats)
    slowest = torch.tensor([t_reduce, t_gather], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    t_reduce, t_gather = slowest.tolist()
    size = numel * 4
    return dict(ranks=n, message_bytes=size,
                all_reduce_busbw_gbps=size / t_reduce * 2 * (n - 1) / n / 1e9,
                all_gather_busbw_gbps=size / t_gather * (n - 1) / n / 1e9)


def _spawned(rank: int, world: int, port: int, backend: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world)
        result = measure()
        if rank == 0:
            queue.put(("ok", result))
    except Exception as e:  # noqa: BLE001 -- reported as the row's reason
        queue.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure_local(num_ranks: int, backend: str, timeout_s: float = 300.0) -> Dict[str, float]:
    """`measure` over ``num_ranks`` processes spawned on this machine."""
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_spawned, args=(r, num_ranks, port, backend, queue)) for r in range(num_ranks)]
    for p in procs:
        p.start()
    try:
        status, value = queue.get(timeout=timeout_s)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if status == "error":
        raise RuntimeError(value)
    return value


def row(result: Dict[str, float], backend: str, device_name: str) -> Check:
    """The row for a measurement: against the nominal NVLink figure on a known GPU inside one node,
    reported without a bound otherwise (gloo, an unknown GPU, or ranks on several nodes)."""
    name = f"{backend}_collectives"
    detail = (f"{result['ranks']} ranks, all-reduce {result['all_reduce_busbw_gbps']:.1f} GB/s, "
              f"all-gather {result['all_gather_busbw_gbps']:.1f} GB/s bus bandwidth")
    nominal = nominal_gbps(device_name) if backend == "nccl" and not result.get("multi_node") else None
    if nominal is None:
        return passed(name, detail + " (results correct; no nominal figure to hold it to)", **result)
    worst = min(result["all_reduce_busbw_gbps"], result["all_gather_busbw_gbps"])
    values = dict(result, nominal_gbps=nominal)
    if worst < HEALTHY_FRACTION * nominal:
        return failed(name, f"{detail}: under {HEALTHY_FRACTION:.0%} of {device_name}'s nominal {nominal:.0f} GB/s "
                            f"(NVLink path missing or NCCL misconfigured?)", **values)
    return passed(name, f"{detail} (nominal {nominal:.0f} GB/s)", **values)


def check_collectives() -> Check:
    """The row on this machine alone: NCCL over its GPUs (skipped with one), gloo over 2 CPU ranks."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count < 2:
            return skipped("nccl_collectives", "one GPU: no NCCL peer on this node (launch/doctor.py on two "
                                               "nodes measures the inter-node figure)")
        return row(measure_local(count, "nccl"), "nccl", torch.cuda.get_device_name(0))
    return row(measure_local(2, "gloo"), "gloo", "cpu")
