"""What `nemo-run` shows of the jobs of a launch: the rendered request of a dry run, and the
jobs of a real launch that did not succeed (NeMo-Run 0.11.1 itself returns 0 when a job fails).

`render_dryrun` prints the sbatch script of a Slurm job (unwrapped from NeMo-Run's log) or the
torchrun command of a local one; nothing is contacted. `failed_jobs` reads the states of the
experiments the command created and names each failed task with its log.
"""

import os
import shutil
from typing import List

import nemo_run as run
from nemo_run.config import get_nemorun_home
from torchx.specs import AppState

FAILED_STATES = (AppState.FAILED, AppState.CANCELLED, AppState.UNKNOWN)
"""Job states after a run that make the exit code non-zero (UNKNOWN: the state was lost)."""


def render_dryrun(task, executor, name: str) -> None:
    """Print what a launch would submit: NeMo-Run's dry-run log (the torchrun command of a
    local job) or, for Slurm, the sbatch script itself, unwrapped. Nothing is contacted: the
    experiment folder is prepared locally and removed again."""
    is_slurm = isinstance(executor, run.SlurmExecutor)
    with run.Experiment(title=name, executor=executor, enable_goodbye_message=False) as experiment:
        experiment.add(task, name=name)
        experiment.dryrun(log=not is_slurm, delete_exp_dir=False)
        folders = set()
        for job in experiment.jobs:
            folders.add(job.executor.experiment_dir)
            if isinstance(job.executor, run.SlurmExecutor):
                path = os.path.join(job.executor.experiment_dir, f"{job.executor.job_name}_sbatch.sh")
                with open(path) as f:
                    print(f"# ---- sbatch script of task {job.id} (dry run; submitted with "
                          f"sbatch --requeue --parsable) ----\n{f.read()}", flush=True)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _new_experiment_ids(started_ns: int) -> List[str]:
    """Experiments created under NEMORUN_HOME since ``started_ns`` (ids end in time_ns())."""
    root = os.path.join(get_nemorun_home(), "experiments")
    ids = []
    for title in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        for exp_id in sorted(os.listdir(os.path.join(root, title))):
            stamp = exp_id.rpartition("_")[2]
            if stamp.isdigit() and int(stamp) >= started_ns:
                ids.append(exp_id)
    return ids


def _log_files(directory: str) -> List[str]:
    """A local job's logs: torchx's combined stdout+stderr per role replica if present."""
    found = []
    for dirpath, _, files in os.walk(directory):
        found += [os.path.join(dirpath, f) for f in files if f.endswith((".log", ".out"))]
    combined = [f for f in found if os.path.basename(f) == "combined.log"]
    return sorted(combined or found)


def failed_jobs(started_ns: int) -> List[str]:
    """One message per job of the experiments this command started that did not succeed."""
    failures = []
    for exp_id in _new_experiment_ids(started_ns):
        experiment = run.Experiment.from_id(exp_id)
        for name, job in (experiment.status(return_dict=True) or {}).items():
            if job["status"] in FAILED_STATES:
                where = job.get("remote_dir") or job["local_dir"]
                logs = _log_files(job["local_dir"]) if not job.get("remote_dir") else []
                failures.append(
                    f"task {name} of experiment {exp_id} ended {job['status'].name}; "
                    f"logs: {', '.join(logs) or where}"
                )
    return failures
