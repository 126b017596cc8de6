"""NeMo-Run executors and tasks for ``launch/*.py``: local torchrun and multi-node Slurm.

Cluster settings come from ``run.executor.<field>=value`` on the command line (NeMo-Run's own
syntax; ``stapo_megatron.launch.cli`` applies them to a launch file's default executor too) or
from these environment variables, read when a launch file builds its executor:

    STAPO_SLURM_ACCOUNT      sbatch --account                                  (required)
    STAPO_CONTAINER_IMAGE    pyxis container image with this package's deps    (required)
    STAPO_SLURM_JOB_DIR      remote directory for NeMo-Run's job folders       (required)
    STAPO_SLURM_PARTITION    sbatch --partition                                (optional)
    STAPO_CONTAINER_MOUNTS   comma-separated src:dst mounts: every data, model and output
                             path must lie under one (or under /nemo_run, the job folder)
    STAPO_SLURM_TIME         sbatch --time, default 04:00:00                   (optional)
    STAPO_HF_HOME            HF_HOME in the job, default /nemo_run/hf_home     (optional)
    STAPO_SLURM_SIGNAL_S     seconds before the time limit at which Slurm sends SIGUSR1 and
                             the trainer saves and stops; default for a paper recipe: 1.5 x
                             the estimated step time of the final configuration + a save
                             (`timing`, `recipes.step_time`), else 600
    STAPO_SLURM_RETRIES      requeues of a job that stopped (the warning signal, or a
                             failure after a new checkpoint: `requeue`); each resumes from the
                             newest checkpoint; default for a paper recipe: the jobs its steps
                             need at the time limit (from the estimated step time of the final
                             configuration) + STAPO_SLURM_FAILURE_RETRIES, else 3
    STAPO_SLURM_FAILURE_RETRIES
                             requeues allowed for failures on top of those, default 5
    STAPO_SLURM_HOST, STAPO_SLURM_USER, STAPO_SLURM_IDENTITY
                             submit over SSH to this login node (default: run on the login
                             node itself, through a LocalTunnel)
    STAPO_CODE_DIR           the git checkout whose code the job runs (default: the one
                             holding this package, wherever nemo-run is started from)

Code reaches a Slurm job as ``git archive`` of the checkout's HEAD (`shipping.code_packager`): a
submission with uncommitted changes (edited or new files that git does not ignore) is refused,
naming them, unless ``--include-uncommitted`` ships the working tree (`shipping.snapshot_commit`).
``nemo-run LAUNCH --emit-sbatch PATH`` writes a plain sbatch + torchrun script instead
(`plain_sbatch_script`: no NeMo-Run, pyxis or container on the cluster).

A required setting that is missing becomes a placeholder ``<unset:VARIABLE>``: a dry run shows
where it goes, `check_submission` refuses a real submission naming each one. This subpackage is the only part of stapo_megatron that imports nemo_run or reads
configuration from the environment.
"""

import getpass
import os
import shlex
import shutil
from typing import Dict, List, Optional, Sequence

import nemo_run as run

from stapo_megatron.launch import requeue
from stapo_megatron.launch.shipping import code_packager
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


def paper_slurm_executor(size: str) -> run.Config:
    """`slurm_executor` for a paper recipe: its nodes, and the save signal and requeue budget
    derived from the recipe's estimated step time at the time limit (``STAPO_SLURM_TIME``;
    `timing.derived_timing`); the variables above still override them. These are the launch
    file's defaults: `nemo-run` derives both again from the final configuration
    (`timing.apply_final`: overrides, ``config=run.yaml``, the executor's nodes)."""
    from stapo_megatron.launch import timing
    from stapo_megatron.recipes.lora import recipe_module

    recipes = recipe_module(size)  # recipes/paper.py, or recipes/lora.py for a LoRA recipe
    layout = recipes.LAYOUTS[size]
    signal_s, retries = timing.derived_timing(size, recipes.paper_recipe(size), layout.num_nodes,
                                              layout.gpus_per_node, _setting("STAPO_SLURM_TIME", DEFAULT_TIME))
    return slurm_executor(layout.num_nodes, layout.gpus_per_node, signal_s=signal_s, retries=retries)


DEFAULT_TIME = "04:00:00"
"""sbatch --time when STAPO_SLURM_TIME is not set (a common partition limit; longer jobs need
fewer requeues)."""


def slurm_executor(nodes: int, gpus_per_node: int = 8, signal_s: Optional[int] = None,
                   retries: Optional[int] = None) -> run.Config:
    """``nodes`` x ``gpus_per_node`` GPUs: one srun task per node starting torchrun with one
    process per GPU, in a pyxis container; the checked-in code is shipped with ``git archive``.

    Before the time limit (``--signal=USR1@S``) torchrun forwards SIGUSR1 to the ranks, which
    save at the next step boundary and stop (`stapo_megatron.trainer.preemption`); the job script
    requeues the job (``retries`` at most; sbatch runs with ``--requeue``; `nemo-run` replaces
    NeMo-Run's requeue-on-any-failure with `requeue.nemo_run_setup` for a recipe) and the requeued
    job resumes from that checkpoint. S must exceed one training step plus a save.
    """
    mounts = _setting("STAPO_CONTAINER_MOUNTS", "")
    signal_s = int(_setting("STAPO_SLURM_SIGNAL_S", str(signal_s or 600)))
    return run.Config(
        run.SlurmExecutor,
        account=_required("STAPO_SLURM_ACCOUNT"),
        partition=_setting("STAPO_SLURM_PARTITION"),
        time=_setting("STAPO_SLURM_TIME", DEFAULT_TIME),
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
        retries=int(_setting("STAPO_SLURM_RETRIES", str(3 if retries is None else retries))),
        tunnel=_tunnel(_required("STAPO_SLURM_JOB_DIR")),
        packager=code_packager(),
    )


RDZV_PORT = 29500
"""The rendezvous port of `plain_sbatch_script` on the job's first node."""


def plain_sbatch_script(executor, recipe: str, arguments: Sequence[str], root: str, name: str,
                        run_dir: str) -> str:
    """A standalone sbatch script running ``torchrun -m stapo_megatron.launch.entry RECIPE ARGS`` on
    every node of ``executor`` (a built SlurmExecutor: nodes, GPUs, time, account, partition, save
    signal, retries, environment) from the checkout ``root`` and its ``.venv`` (``STAPO_VENV``
    overrides it): for clusters without pyxis / containers or NeMo-Run. The job requeues itself
    after the save signal, or after a failure that followed a new checkpoint in ``run_dir``
    (`requeue`), ``executor.retries`` times at most (``SLURM_RESTART_COUNT``)."""
    signal_s = int(str(executor.signal or "USR1@600").rpartition("@")[2])
    lines = ["#!/bin/bash",
             f"# {recipe} with plain sbatch + torchrun (written by nemo-run --emit-sbatch; no NeMo-Run, no container).",
             f"# The nodes run the code of {root} as it is when the job starts, with its .venv",
             "# (or $STAPO_VENV): both must be on a file system the compute nodes see. Submit: sbatch THIS_FILE",
             f"#SBATCH --job-name={executor.job_name_prefix or ''}{name}",
             f"#SBATCH --nodes={executor.nodes}",
             "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={executor.gpus_per_node}",
             "#SBATCH --exclusive",
             f"#SBATCH --time={executor.time}",
             f"#SBATCH --signal=USR1@{signal_s}",
             "#SBATCH --requeue",
             "#SBATCH --open-mode=append"]
    for option, value in (("account", executor.account), ("partition", executor.partition)):
        if value and not str(value).startswith(PLACEHOLDER_PREFIX):
            lines.append(f"#SBATCH --{option}={value}")
    lines += ["", "set -uo pipefail", f"cd {shlex.quote(root)}",
              f'export PATH="${{STAPO_VENV:-{root}/.venv}}/bin:$PATH"']
    for key, value in executor.env_vars.items():
        if key == "HF_HOME" and str(value).startswith("/nemo_run/"):
            continue  # NeMo-Run's folder inside the container; without one HF_HOME stays the user's
        lines.append(f"export {key}={shlex.quote(str(value))}")
    command = ["srun --kill-on-bad-exit=1 torchrun", '--nnodes="$SLURM_NNODES"',
               f"--nproc-per-node={executor.gpus_per_node}", "--rdzv-backend=c10d",
               f'--rdzv-endpoint="$head:{RDZV_PORT}"', '--rdzv-id="$SLURM_JOB_ID"',
               f"-m stapo_megatron.launch.entry {shlex.quote(recipe)}", *(shlex.quote(a) for a in arguments)]
    lines += ['head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              *requeue.plain_lines(run_dir, int(executor.retries), " \\\n    ".join(command)), ""]
    return "\n".join(lines)


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


def missing_sbatch(executor) -> List[str]:
    """A Slurm executor that submits on this machine (`run.LocalTunnel`: no ``STAPO_SLURM_HOST``)
    needs ``sbatch`` here; without it NeMo-Run fails only after creating the experiment, with
    "sbatch: command not found"."""
    if (not isinstance(executor, run.SlurmExecutor) or not isinstance(executor.tunnel, run.LocalTunnel)
            or shutil.which("sbatch")):
        return []
    return ["sbatch is not on this machine's PATH: run nemo-run on the cluster's login node, set "
            "STAPO_SLURM_HOST (and STAPO_SLURM_USER) to submit over SSH, or write a script with "
            "--emit-sbatch and submit it there"]


def check_submission(executor) -> None:
    """Raise ValueError naming every required Slurm setting ``executor`` misses."""
    missing = unset_settings(executor)
    if missing:
        raise ValueError("cannot submit to Slurm, missing: " + "; ".join(missing))


def recipe_task(recipe: str, **arguments) -> run.Partial:
    """The task of a launch file: `entry.run_recipe` for ``recipe``. The config sections are
    dicts (``arguments``' own, or empty), each holding one for each of its own sections
    (`section_task`), so that ``section.field=value`` and ``section.sub.field=value`` overrides
    parse as NeMo-Run attributes."""
    from stapo_megatron.launch import entry

    sections = {name: section_task(entry.SUBSECTIONS[name], arguments.pop(name, None)) for name in entry.SECTIONS}
    return run.Partial(entry.run_recipe, recipe=recipe, **sections, **arguments)


def section_task(subsections: dict, given: Optional[run.Config] = None) -> run.Config:
    """A config section of a launch task: ``given`` (a ``run.Config(entry.section, ...)``, or a
    new empty one) with an empty one for each of its own sections it does not set
    (``entry.SUBSECTIONS``), so that NeMo-Run finds every attribute a nested override
    (``loss.rollout_correction.mode=none``) walks through."""
    from stapo_megatron.launch import entry

    out = run.Config(entry.section) if given is None else given
    for name, below in subsections.items():
        setattr(out, name, section_task(below, getattr(out, name, None)))
    return out


@run.cli.factory(target=run.LocalExecutor, name="local")
def local(nproc_per_node: int = 2) -> run.Config:
    """``run.executor=local``: torchrun on this machine."""
    return local_executor(nproc_per_node)


@run.cli.factory(target=run.SlurmExecutor, name="slurm")
def slurm(nodes: int = 1, gpus_per_node: int = 8) -> run.Config:
    """``run.executor=slurm``: the Slurm executor above."""
    return slurm_executor(nodes, gpus_per_node)
