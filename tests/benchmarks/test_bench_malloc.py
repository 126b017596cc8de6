"""The CPU benchmarks' allocator check (benchmarks/malloc_check.py): it tells jemalloc mapped from
jemalloc merely named in LD_PRELOAD (the loader skips a missing library and runs on), and every
CPU-timing benchmark calls it."""

import importlib.util
import os
import subprocess
import sys

import pytest
from tests.helpers import REPO_DIR

BENCHMARKS = os.path.join(REPO_DIR, "benchmarks")
_spec = importlib.util.spec_from_file_location("malloc_check", os.path.join(BENCHMARKS, "malloc_check.py"))
malloc_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(malloc_check)
JEMALLOC = malloc_check.JEMALLOC

NOT_CPU_TIMING = {"bench_context_parallel.py", "bench_gpu_step.py", "bench_router_replay.py"}
"""Counts bytes (exact) / times a GPU / compares log-probs: no allocator check (malloc_check's docstring)."""


def _check(ld_preload):
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if ld_preload is not None:
        env["LD_PRELOAD"] = ld_preload
    code = f"import sys; sys.path.insert(0, {BENCHMARKS!r}); from malloc_check import check_jemalloc; check_jemalloc()"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)


@pytest.mark.skipif(not os.path.exists(JEMALLOC), reason=f"{JEMALLOC} is not installed (`make bench` installs it)")
def test_preloaded_jemalloc_is_seen():
    run = _check(JEMALLOC)
    assert run.stdout == "jemalloc: true\n" and "WARNING" not in run.stderr


@pytest.mark.parametrize("ld_preload", [None, "/nonexistent/libjemalloc.so.2"])
def test_missing_jemalloc_is_recorded_and_warned(ld_preload):
    run = _check(ld_preload)
    assert run.stdout == "jemalloc: false\n"
    assert "WARNING: jemalloc is NOT loaded" in run.stderr and f"LD_PRELOAD={ld_preload or ''!r}" in run.stderr


def test_every_cpu_timing_benchmark_checks_the_allocator():
    scripts = sorted(f for f in os.listdir(BENCHMARKS) if f.startswith("bench_") and f.endswith(".py"))
    assert NOT_CPU_TIMING < set(scripts)
    for name in sorted(set(scripts) - NOT_CPU_TIMING):
        source = open(os.path.join(BENCHMARKS, name)).read()
        assert "from malloc_check import check_jemalloc" in source and "check_jemalloc()" in source, name
