"""The requeue rules of the job scripts (`stapo_megatron.launch.requeue`), run in real bash.

Each case runs the rendered fragment as the job script runs it: before the attempt, the
"training" (a bash line that writes checkpoint folders and the ``latest`` marker as the trainer
does, or the stop marker, and exits with a code), after it the decision. ``scontrol`` is a
script on PATH that records its arguments (there is no Slurm here); nothing else is replaced.
"""

import os
import subprocess

import pytest

from stapo_megatron.launch import requeue
from tests.helpers.launch_cli import SAVE


def run_attempt(tmp_path, training: str, restart_count: int = 0, retries: int = 3, nemo_run: bool = False):
    """(exit code, job log, scontrol calls) of one attempt whose training runs ``training``."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000010").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000010\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "scontrol_calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    attempt = f"RUN={run_dir}; ( {training} )"
    if nemo_run:  # NeMo-Run's template: retries exported first, the setup lines, then the srun
        script = "\n".join([f"export TORCHX_MAX_RETRIES={retries}", "set +e", requeue.nemo_run_setup(str(run_dir)),
                            attempt, "exitcode=$?", "set -e", "if [ $exitcode -ne 0 ]; then",
                            '    if [ "$TORCHX_MAX_RETRIES" -gt "${SLURM_RESTART_COUNT:-0}" ]; then',
                            '        scontrol requeue "$SLURM_JOB_ID"', "    fi", "    exit $exitcode", "fi"])
    else:
        script = "\n".join(["set -uo pipefail", *requeue.plain_lines(str(run_dir), retries, attempt)])
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_RESTART_COUNT": str(restart_count)}
    proc = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    made = calls.read_text().splitlines() if calls.exists() else []
    return proc.returncode, proc.stdout, made


@pytest.mark.parametrize("nemo_run", [False, True])
def test_a_stop_at_the_save_signal_requeues(tmp_path, nemo_run):
    """torchrun turns the workers' 75 into 1: the marker the entry leaves decides."""
    code, log, calls = run_attempt(tmp_path, SAVE + 'echo 20 > "$RUN/stopped_for_requeue"; exit 1', nemo_run=nemo_run)
    assert code == 1 and calls == ["requeue 4242"], log
    assert "stapo-requeue: stopped at the save signal (exit 1, checkpoint step_00000020): requeue 1 of 3" in log
    code, log, calls = run_attempt(tmp_path / "b", "exit 75", nemo_run=nemo_run)
    assert code == 75 and calls == ["requeue 4242"], log


@pytest.mark.parametrize("nemo_run", [False, True])
def test_a_crash_after_a_new_checkpoint_requeues(tmp_path, nemo_run):
    code, log, calls = run_attempt(tmp_path, SAVE + "exit 1", restart_count=1, nemo_run=nemo_run)
    assert code == 1 and calls == ["requeue 4242"], log
    assert ("stapo-requeue: failed (exit 1) after a new checkpoint step_00000020 (this attempt started from "
            "step_00000010): requeue 2 of 3") in log


@pytest.mark.parametrize("nemo_run", [False, True])
def test_a_crash_without_a_new_checkpoint_is_not_requeued(tmp_path, nemo_run):
    """A deterministic failure (a save that always fails) would otherwise loop up to the budget."""
    code, log, calls = run_attempt(tmp_path, 'mkdir -p "$RUN/checkpoints/.tmp_step_00000020"; exit 1',
                                   nemo_run=nemo_run)
    assert code == 1 and calls == [], log
    assert ("stapo-requeue: failed (exit 1) with no new checkpoint since this attempt started (step_00000010): "
            "not requeued") in log


def test_a_stale_marker_of_an_earlier_attempt_does_not_count(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / requeue.STOPPED_MARKER).write_text("10\n")
    code, log, calls = run_attempt(tmp_path, "exit 1")
    assert code == 1 and calls == [] and "not requeued" in log, log


@pytest.mark.parametrize("nemo_run", [False, True])
def test_success_and_a_spent_budget_are_not_requeued(tmp_path, nemo_run):
    code, log, calls = run_attempt(tmp_path, SAVE + "exit 0", nemo_run=nemo_run)
    assert code == 0 and calls == [] and "stapo-requeue" not in log, log
    code, log, calls = run_attempt(tmp_path / "b", "exit 75", restart_count=3, nemo_run=nemo_run)
    assert code == 75 and calls == [], log
    assert "retry budget spent (3 of 3 requeues): not requeued" in log


def test_mark_stopped_writes_the_step(tmp_path):
    path = requeue.mark_stopped(str(tmp_path), 20)
    assert path == str(tmp_path / requeue.STOPPED_MARKER) and open(path).read() == "20\n"
    assert sorted(os.listdir(tmp_path)) == [requeue.STOPPED_MARKER]


