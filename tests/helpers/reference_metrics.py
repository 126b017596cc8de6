"""Reference metrics of the tiny separate-placement runs (`tests/assets/reference_metrics/`): the
fixed-seed rows a refactor that is not meant to change the maths must write again, value for value
(wall-clock fields aside, `scripts/compare_metrics.py`).

The files are the runs' ``metrics.jsonl`` on the CPU test machine (gloo, OMP_NUM_THREADS=1). A
change that is meant to change the maths (seeds, sampling, the loss) writes them again: run the test
and copy its run's ``metrics.jsonl`` over the file it names, or launch the same run by hand,

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv/bin/python -m torch.distributed.run \\
        --nproc-per-node N tests/helpers/separate_script.py OUT none ARGS...
    cp OUT/metrics.jsonl tests/assets/reference_metrics/NAME.jsonl

with the test's N and ARGS, and say in the commit why the values moved.

CPUs whose fp32 kernels round differently (the vector width oneDNN and the compiler pick: AVX2 or
AVX-512) write values that differ in the fifth digit after a few steps (the warm-start's 50 SGD
steps amplify one rounding of a GEMM), and the metrics that measure fp32 noise themselves (the
rollout/training log-prob differences, ~1e-6) differ by tens of percent. No tolerance separates
that from a change of the maths, so such a CPU has its own reference, ``NAME.<kind>.jsonl`` beside
``NAME.jsonl`` (``<kind>``: the machine it was written on, e.g. ``avx512``), written as above; a run
matches when it is the same as one of them. Sampled tokens, counts and lengths are the same in all
of them (the sampling is seeded; the noise moves no token at these seeds).
"""

import os

from tests.helpers import TESTS_DIR
from tests.helpers.repo_scripts import compare_metrics

REFERENCE_DIR = os.path.join(TESTS_DIR, "assets", "reference_metrics")
REL_TOL = 1e-5
"""Floats within this of a reference are the same (a rerun on the same kind of CPU writes them to
the bit; the margin is for a library's reduction order). Counts, token ids and anything sampled
must match exactly."""


def reference_paths(name: str) -> list:
    """The reference ``name`` and its variants of other CPUs (module docstring), ``NAME.jsonl`` first."""
    variants = sorted(p for p in os.listdir(REFERENCE_DIR) if p.startswith(f"{name}.") and p != f"{name}.jsonl")
    return [os.path.join(REFERENCE_DIR, p) for p in [f"{name}.jsonl", *variants]]


def reference_differences(name: str, run_dir) -> list:
    """How ``run_dir``'s metrics differ from the reference ``name`` (module docstring): [] when
    they are the same as one of its variants, else the differences from ``NAME.jsonl``."""
    run = compare_metrics.load_rows(os.path.join(run_dir, "metrics.jsonl"))
    found = [compare_metrics.differences(compare_metrics.load_rows(path), run, rel_tol=REL_TOL)
             for path in reference_paths(name)]
    return [] if [] in found else found[0]
