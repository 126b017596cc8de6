"""NeMo-Run executors and tasks for ``launch/*.py``: local torchrun and multi-node Slurm.

Cluster settings come from ``run.executor.<field>=value`` on the command line (NeMo-Run's own
syntax; ``stapo_megatron.launch.cli`` applies them to a launch file's default executor too) or
from these environment variables, read when a launch file builds its executor:

    STAPO_SLURM_ACCOUNT      sbatch --account                                  (required)
    STAPO_CONTAINER_IMAGE    pyxis container image with this package's deps    (required)
    STAPO_SLURM_JOB_DIR      remote directory for NeMo-Run's job folders       (required)
    STAPO_SLURM_PARTITION    sbatch --partition                                (optional)
    STAPO_CONTAINER_MOUNTS   comma-separated src:dst mounts                    (optional)
    STAPO_SLURM_TIME         sbatch --time, default 04:00:00                   (optional)
    STAPO_HF_HOME            HF_HOME in the job, default /nemo_run/hf_home     (optional)
    STAPO_SLURM_SIGNAL_S     seconds before the time limit at which Slurm sends SIGUSR1 and
                             the trainer saves and stops, default 600           (optional)
    STAPO_SLURM_RETRIES      requeues of a job that stopped (the warning signal or a
                             failure); each resumes from the newest checkpoint, default 3
    STAPO_SLURM_HOST, STAPO_SLURM_USER, STAPO_SLURM_IDENTITY
                             submit over SSH to this login node (default: run on the login
                             node itself, through a LocalTunnel)

A required setting that is missing becomes a placeholder ``<unset:VARIABLE>``: a dry run shows
where it goes, `check_submission` refuses a real submission naming each one. Together with
``cli.py`` this subpackage is the only part of stapo_megatron that imports nemo_run or reads
configuration from the environment.
"""

import getpass
import os
from typing import Dict, List, Optional

import nemo_run as run

from stapo_megatron.trainer.preemption import torchrun_env

PLACEHOLDER_PREFIX = "<unset:"
"""Marks a required Slurm setting that was not given (``<unset:VARIABLE>``, dry runs only)."""

REQUIRED = {
    "account": ("STAPO_SLURM_ACCOUNT", "run.executor.account"),
    "container_image": ("STAPO_CONTAINER_IMAGE", "run.executor.container_image"),
    "tunnel.job_dir": ("STAPO_SLURM_JOB_DIR", "run.executor.tunnel.job_dir"),
}
"""Slurm settings a real submission needs: field -> (environment variable, override key)."""

RDZV_JOIN_TIMEOUT_S = 300
"""torchrun's rendezvous ``join_timeout`` on Slurm: how long one node's agent waits for all the
others (a node that never starts ends the job after this long)."""

LOCAL_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
"""Worker environment of local runs: vLLM's engine core in the training process (weight sync
passes Python iterators to it)."""

CLUSTER_ENV = {
    **LOCAL_ENV,
    # compute nodes read models and data from the paths given; nothing is downloaded
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # Megatron: one CUDA work queue keeps TP / sequence-parallel communication ordered
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    # NVLink SHARP buffers cost GPU memory that colocated vLLM + Megatron need
    "NCCL_NVLS_ENABLE": "0",
    # torchrun reads its options' defaults from PET_* variables: a node's agent whose peers do
    # not all join the rendezvous gives up after 5 minutes (torch's default: 10), time enough
    # for every node's container to start
    "PET_RDZV_CONF": f"join_timeout={RDZV_JOIN_TIMEOUT_S}",
}
"""Worker environment of Slurm runs (plus HF_HOME)."""


def _setting(variable: str, default: Optional[str] = None) -> Optional[str]:
    return os.environ.get(variable) or default


def _required(variable: str) -> str:
    return _setting(variable, f"{PLACEHOLDER_PREFIX}{variable}>")


def local_executor(nproc_per_node: int = 2, env_vars: Optional[Dict[str, str]] = None) -> run.Config:
    """torchrun with ``nproc_per_node`` processes on this machine (gloo on CPU, NCCL on GPU)."""
    return run.Config(
        run.LocalExecutor, ntasks_per_node=nproc_per_node, launcher="torchrun",
        env_vars={**LOCAL_ENV, **(env_vars or {})},
    )


def _tunnel(job_dir: str) -> run.Config:
    host = _setting("STAPO_SLURM_HOST")
    if not host:
        return run.Config(run.LocalTunnel, job_dir=job_dir)
    return run.Config(
        run.SSHTunnel, host=host, user=_setting("STAPO_SLURM_USER", getpass.getuser()),
        job_dir=job_dir, identity=_setting("STAPO_SLURM_IDENTITY"),
    )


def slurm_executor(nodes: int, gpus_per_node: int = 8) -> run.Config:
    """``nodes`` x ``gpus_per_node`` GPUs: one srun task per node starting torchrun with one
    process per GPU, in a pyxis container; the checked-in code is shipped with ``git archive``.

    Before the time limit (``--signal=USR1@S``) torchrun forwards SIGUSR1 to the ranks, which
    save at the next step boundary and stop (`stapo_megatron.trainer.preemption`); the non-zero exit
    makes NeMo-Run's sbatch script requeue the job (``retries``; sbatch runs with ``--requeue``)
    and the requeued job resumes from that checkpoint. S must exceed one training step plus a save.
    """
    mounts = _setting("STAPO_CONTAINER_MOUNTS", "")
    signal_s = int(_setting("STAPO_SLURM_SIGNAL_S", "600"))
    return run.Config(
        run.SlurmExecutor,
        account=_required("STAPO_SLURM_ACCOUNT"),
        partition=_setting("STAPO_SLURM_PARTITION"),
        time=_setting("STAPO_SLURM_TIME", "04:00:00"),
        # NeMo-Run's default prefix repeats the account ("acct-acct.<task>")
        job_name_prefix="stapo-megatron.",
        nodes=nodes,
        ntasks_per_node=gpus_per_node,
        gpus_per_node=gpus_per_node,
        exclusive=True,
        container_image=_required("STAPO_CONTAINER_IMAGE"),
        container_mounts=[m for m in mounts.split(",") if m],
        launcher="torchrun",
        env_vars={**CLUSTER_ENV, **torchrun_env(signal_s), "HF_HOME": _setting("STAPO_HF_HOME", "/nemo_run/hf_home")},
        signal=f"USR1@{signal_s}",
        retries=int(_setting("STAPO_SLURM_RETRIES", "3")),
        tunnel=_tunnel(_required("STAPO_SLURM_JOB_DIR")),
        packager=run.Config(run.GitArchivePackager),
    )


def unset_settings(executor) -> List[str]:
    """What a real submission of ``executor`` (a built SlurmExecutor) still misses."""
    if not isinstance(executor, run.SlurmExecutor):
        return []
    missing = []
    for field, (variable, key) in REQUIRED.items():
        value = executor.tunnel.job_dir if field == "tunnel.job_dir" else getattr(executor, field)
        if not value or str(value).startswith(PLACEHOLDER_PREFIX):
            missing.append(f"{field} (set {variable} or {key}=...)")
    return missing


def check_submission(executor) -> None:
    """Raise ValueError naming every required Slurm setting ``executor`` misses."""
    missing = unset_settings(executor)
    if missing:
        raise ValueError("cannot submit to Slurm, missing: " + "; ".join(missing))


def recipe_task(recipe: str, **arguments) -> run.Partial:
    """The task of a launch file: `entry.run_recipe` for ``recipe``. The config sections are
    empty dicts so that ``section.field=value`` overrides parse as NeMo-Run attributes."""
    from stapo_megatron.launch import entry

    sections = {name: run.Config(entry.section) for name in entry.SECTIONS}
    return run.Partial(entry.run_recipe, recipe=recipe, **{**sections, **arguments})


@run.cli.factory(target=run.LocalExecutor, name="local")
def local(nproc_per_node: int = 2) -> run.Config:
    """``run.executor=local``: torchrun on this machine."""
    return local_executor(nproc_per_node)


@run.cli.factory(target=run.SlurmExecutor, name="slurm")
def slurm(nodes: int = 1, gpus_per_node: int = 8) -> run.Config:
    """``run.executor=slurm``: the Slurm executor above."""
    return slurm_executor(nodes, gpus_per_node)
