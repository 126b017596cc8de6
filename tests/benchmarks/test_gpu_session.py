"""Tier a: benchmarks/gpu_session.sh's agenda without running it (``--plan``: each admitted part
is taken to last its budget): the order of the parts, the deadline that skips a part that would
not fit and still admits a later, shorter one, ``--only``, and the GPU tier split into three
parts that together are ``-m gpu tests``."""

import os
import re
import subprocess

import pytest

from tests.helpers import REPO_DIR

SCRIPT = os.path.join(REPO_DIR, "benchmarks", "gpu_session.sh")
ORDER = ["bench_gpu_step_packed_16k", "saved_bytes", "pytest_gpu_quick", "pytest_gpu_trainer", "pytest_gpu_router",
         "bench_logprob_entropy_16k", "doctor", "bench_gpu_step_no_recompute"]
"""What was never measured first (the packed 16k row, the SwiGLU row), then the GPU tier's parts."""
BUDGETS = dict(bench_gpu_step_packed_16k=120, saved_bytes=60, pytest_gpu_quick=220, pytest_gpu_trainer=200,
               pytest_gpu_router=70, bench_logprob_entropy_16k=150, doctor=45, bench_gpu_step_no_recompute=60)


def _plan(tmp_path, *args):
    """(name, 'START' or 'SKIPPED', at seconds) per part of a --plan run, and its skipped.txt."""
    out = tmp_path / "out"
    proc = subprocess.run(["bash", SCRIPT, "--plan", *args], env=dict(os.environ, OUT=str(out)), cwd=REPO_DIR,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    rows = [(m.group(3), m.group(2), int(m.group(1)))
            for m in re.finditer(r"^\s*(\d+)s (START|SKIPPED) (\w+):", proc.stdout, re.M)]
    assert (out / "session.log").read_text() == proc.stdout  # every line of the plan is logged
    return rows, (out / "skipped.txt").read_text().split(), proc.stdout


def test_parts_run_in_order_each_admitted_only_if_its_budget_fits(tmp_path):
    rows, skipped, _ = _plan(tmp_path)
    assert [name for name, _, _ in rows] == ORDER
    # the default deadline, 570 s: each part starts when its predecessors' budgets are spent
    clock, want = 0, []
    for name in ORDER:
        fits = clock + BUDGETS[name] <= 570
        want.append((name, "START" if fits else "SKIPPED", clock))
        clock += BUDGETS[name] if fits else 0
    assert rows == want
    assert skipped == [name for name, status, _ in want if status == "SKIPPED"]
    assert ("pytest_gpu_router", "START", 400) in rows  # after the trainer test was skipped at 400 s


@pytest.mark.parametrize("deadline,started", [
    (100, ["saved_bytes"]),  # the first part (120 s) skipped, the second (60 s) run
    (180, ["bench_gpu_step_packed_16k", "saved_bytes"]),  # both, then nothing fits
])
def test_a_part_that_would_not_fit_is_skipped_and_a_later_one_may_run(tmp_path, deadline, started):
    rows, skipped, _ = _plan(tmp_path, "--deadline", str(deadline))
    assert [name for name, status, _ in rows if status == "START"] == started
    assert sum(BUDGETS[name] for name, status, _ in rows if status == "START") <= deadline
    assert set(skipped) == {name for name, status, _ in rows if status == "SKIPPED"} and skipped


def test_only_runs_the_named_parts(tmp_path):
    rows, skipped, out = _plan(tmp_path, "--only", "doctor,pytest_gpu_trainer", "--deadline", "100")
    assert rows == [("pytest_gpu_trainer", "SKIPPED", 0), ("doctor", "START", 0)]
    assert skipped == ["pytest_gpu_trainer"] and "only doctor,pytest_gpu_trainer" in out


def test_the_tier_parts_select_every_gpu_test_once(tmp_path):
    """The quick part is ``-m gpu tests`` without the two long tests, which the other two parts
    select by file and name (and a bad argument is refused)."""
    _, _, out = _plan(tmp_path)
    quick = re.search(r"START pytest_gpu_quick: .* -m gpu tests -k (.*)$", out, re.M).group(1)
    assert quick == "not router_replay and not test_cuda_steps_checkpoint_and_resume_equal_the_cpu"
    assert re.search(r"START pytest_gpu_router: .* -m gpu tests/gpu/test_gpu.py -k router_replay$", out, re.M)
    assert "test_cuda_steps_checkpoint_and_resume_equal_the_cpu" in open(
        os.path.join(REPO_DIR, "tests", "gpu", "test_trainer_s2t.py")).read()
    proc = subprocess.run(["bash", SCRIPT, "--bogus"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown argument --bogus" in proc.stderr
