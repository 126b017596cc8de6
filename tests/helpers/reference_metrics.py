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
"""

import os

from tests.helpers import TESTS_DIR
from tests.helpers.repo_scripts import compare_metrics

REFERENCE_DIR = os.path.join(TESTS_DIR, "assets", "reference_metrics")
REL_TOL = 1e-5
"""Floats within this of the reference are the same: a CPU whose kernels round differently (another
vector width) moves the last digits of a loss, not what a change of the maths moves. Counts,
token ids and anything sampled must match exactly."""


def reference_differences(name: str, run_dir) -> list:
    """How ``run_dir``'s metrics differ from the reference ``name`` (module docstring); [] when the same."""
    reference = compare_metrics.load_rows(os.path.join(REFERENCE_DIR, f"{name}.jsonl"))
    run = compare_metrics.load_rows(os.path.join(run_dir, "metrics.jsonl"))
    return compare_metrics.differences(reference, run, rel_tol=REL_TOL)
