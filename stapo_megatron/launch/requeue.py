"""When a Slurm job requeues itself: a time-limit stop always, a crash only after progress.

Slurm's ``--signal`` makes the trainer save and stop (`stapo_megatron.trainer.preemption`, exit
code 75); `entry.run_recipe` then leaves the `STOPPED_MARKER` file in the run folder (torchrun
turns its workers' 75 into its own exit code 1, so the code alone does not reach the script). The
job script's `bash_functions` decide after each attempt:

    exit 0                                   done, no requeue
    exit 75 or the marker present            stopped at the save signal: requeue
    another failure, a new checkpoint        requeue (the next attempt resumes from it)
      (``checkpoints/latest`` changed since
      this attempt started)
    another failure, no new checkpoint       not requeued: the same failure would repeat from
                                             the same checkpoint until the retry budget is spent
    SLURM_RESTART_COUNT at the budget        not requeued

and say which in the job log. The same functions serve NeMo-Run's sbatch script (`nemo_run_setup`:
its own requeue-on-any-failure is switched off and an EXIT trap calls them) and the plain
``--emit-sbatch`` script (`plain_lines`). No nemo_run import.
"""

import os
import shlex
from typing import List

REQUEUE_EXIT_CODE = 75
"""The trainer's exit code after a save on the warning signal (os.EX_TEMPFAIL,
`stapo_megatron.trainer.preemption.REQUEUE_EXIT_CODE`; not imported: no torch here)."""

STOPPED_MARKER = "stopped_for_requeue"
"""File in the run folder: the last attempt saved and stopped on the warning signal (its text:
the step it saved)."""

LOG_PREFIX = "stapo-requeue:"
"""How the requeue decision starts in the job log."""


def mark_stopped(run_dir: str, step: int) -> str:
    """Write `STOPPED_MARKER` in ``run_dir`` (atomically: one rank per process writes a copy and
    renames it); returns its path."""
    path = os.path.join(run_dir, STOPPED_MARKER)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{step}\n")
    os.replace(tmp, path)
    return path


def bash_functions(run_dir: str, retries: str) -> str:
    """Bash defining ``stapo_before_attempt`` (note the newest checkpoint, clear the marker) and
    ``stapo_after_attempt CODE`` (requeue or not, logged) for the run folder ``run_dir`` as the
    batch host sees it; ``retries`` is a bash word (a number or ``$VARIABLE``) for the budget."""
    folder = shlex.quote(run_dir)
    return "\n".join([
        f"# requeue only what can progress (stapo_megatron/launch/requeue.py)",
        f"stapo_run_dir={folder}",
        f"stapo_retries={retries}",
        'stapo_latest() { cat "$stapo_run_dir/checkpoints/latest" 2>/dev/null || true; }',
        "stapo_before_attempt() {",
        '    stapo_started_from=$(stapo_latest)',
        f'    rm -f "$stapo_run_dir/{STOPPED_MARKER}"',
        "}",
        "stapo_after_attempt() {",
        '    local code=$1 attempt=${SLURM_RESTART_COUNT:-0} now reason',
        '    now=$(stapo_latest)',
        '    [ "$code" -eq 0 ] && return 0',
        f'    if [ "$code" -eq {REQUEUE_EXIT_CODE} ] || [ -e "$stapo_run_dir/{STOPPED_MARKER}" ]; then',
        '        reason="stopped at the save signal (exit $code, checkpoint ${now:-none})"',
        '    elif [ -n "$now" ] && [ "$now" != "$stapo_started_from" ]; then',
        '        reason="failed (exit $code) after a new checkpoint $now (this attempt started from '
        '${stapo_started_from:-none})"',
        "    else",
        f'        echo "{LOG_PREFIX} failed (exit $code) with no new checkpoint since this attempt started '
        '(${stapo_started_from:-none}): not requeued, a requeue would repeat the failure"',
        "        return 0",
        "    fi",
        '    if [ "$attempt" -ge "$stapo_retries" ]; then',
        f'        echo "{LOG_PREFIX} $reason; retry budget spent ($attempt of $stapo_retries requeues): not requeued"',
        "        return 0",
        "    fi",
        f'    echo "{LOG_PREFIX} $reason: requeue $((attempt + 1)) of $stapo_retries"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "}",
    ])


def nemo_run_setup(run_dir: str) -> str:
    """``setup_lines`` of NeMo-Run's sbatch script: its requeue on any non-zero exit (driven by
    ``TORCHX_MAX_RETRIES``, the executor's ``retries``) is switched off, and an EXIT trap applies
    `bash_functions` with that budget to the script's exit code."""
    return "\n".join([
        "stapo_budget=$TORCHX_MAX_RETRIES",
        "export TORCHX_MAX_RETRIES=0  # NeMo-Run's requeue on any failure: off; stapo_after_attempt decides",
        bash_functions(run_dir, "$stapo_budget"),
        "stapo_before_attempt",
        "trap 'stapo_after_attempt $?' EXIT",
    ])


def plain_lines(run_dir: str, retries: int, command: str) -> List[str]:
    """The lines of the plain sbatch script around its ``srun ... torchrun`` ``command``."""
    return [bash_functions(run_dir, str(int(retries))), "stapo_before_attempt", command, "code=$?",
            'stapo_after_attempt "$code"', 'exit "$code"']
