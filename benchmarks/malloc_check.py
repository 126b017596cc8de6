"""The CPU-timing benchmarks' allocator check, shared by every bench_*.py that times the CPU.

Their timings run under jemalloc (benchmarks/RESULTS.md says why: so that they time compute
rather than first-touch page faults, which vary 3-10x between runs on these VMs). `make bench`
preloads it, but naming a library in LD_PRELOAD proves nothing: the loader skips a missing one
with a single line on stderr and runs on. So `check_jemalloc` reads this process's memory map,
prints ``jemalloc: true`` or ``jemalloc: false`` as a line of the benchmark's output (recorded with
its numbers), and when false warns loudly on stderr.

Not checked: benchmarks that count rather than time (bench_context_parallel.py's saved
activations, bench_router_replay.py's log-prob mismatch) or time a GPU (bench_gpu_step.py,
bench_logprob_entropy.py --device cuda).
"""

from __future__ import annotations

import os
import sys

JEMALLOC = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"
"""Debian's libjemalloc2, the library `make bench` installs and preloads."""


def jemalloc_mapped(maps_path: str = "/proc/self/maps") -> bool:
    """Whether a libjemalloc is mapped into this process (False where there is no procfs: not
    Linux, so it cannot be told)."""
    if not os.path.exists(maps_path):
        return False
    with open(maps_path) as maps:
        return "libjemalloc" in maps.read()


def check_jemalloc() -> bool:
    """Print ``jemalloc: true|false`` on stdout, and when false a warning on stderr naming what
    LD_PRELOAD held and how to fix it; returns the verdict. Call it first in a CPU-timing
    benchmark (before its children start: they inherit the same environment)."""
    mapped = jemalloc_mapped()
    print(f"jemalloc: {str(mapped).lower()}", flush=True)
    if not mapped:
        print(f"\nWARNING: jemalloc is NOT loaded in this process (LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r}).\n"
              "WARNING: the timings below are under glibc malloc (first-touch page faults included) and not\n"
              "WARNING: comparable with benchmarks/RESULTS.md. `make bench` installs and preloads it; by hand:\n"
              f"WARNING:   apt-get install libjemalloc2 && LD_PRELOAD={JEMALLOC} .venv/bin/python benchmarks/...\n",
              file=sys.stderr, flush=True)
    return mapped
