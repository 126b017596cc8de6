"""The ``nemo-run`` command on the launch files, through the installed console script.

Dry runs render the Slurm sbatch scripts (no cluster, no SSH) and the local torchrun command;
a real submission with missing settings or a bad override is refused before anything starts;
the exit code of a local job follows its final state (NeMo-Run's own CLI returns 0 either way).
NeMo-Run's ids and timestamps in the scripts are matched with patterns.
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from stapo_megatron.method.registry import METHODS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEMO_RUN = os.path.join(os.path.dirname(sys.executable), "nemo-run")
ID = r"\d+"  # NeMo-Run experiment ids end in time.time_ns()

pytest.importorskip("nemo_run")
# every test starts the `nemo-run` command (10-30 s of imports each): the slow tier
pytestmark = pytest.mark.slow


def nemo_run(tmp_path, *args, env=None, timeout=300):
    """Run ``nemo-run ARGS`` from the checkout with its own NEMORUN_HOME and no STAPO_* settings."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_")}
    # NEMORUN_HOME: experiments and local job states go to tmp; COLUMNS: rich tables unwrapped
    environ.update(NEMORUN_HOME=str(tmp_path / "nemo_run_home"), COLUMNS="250", **(env or {}))
    proc = subprocess.run([NEMO_RUN, *args], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def sbatch_script(output: str) -> str:
    match = re.search(r"^# ---- sbatch script of task .*?\n(#!/bin/bash.*)", output, re.M | re.S)
    assert match, output
    return match.group(1)


OVERRIDES = [
    "run.executor.account=stapo-acct",
    "run.executor.container_image=nvcr.io/nvidia/nemo:25.09",
    "run.executor.container_mounts=['/lustre:/lustre','/scratch/hf:/hf']",
    "run.executor.tunnel.job_dir=/lustre/stapo/jobs",
]
ENV_SETTINGS = {
    "STAPO_SLURM_ACCOUNT": "stapo-acct", "STAPO_CONTAINER_IMAGE": "nvcr.io/nvidia/nemo:25.09",
    "STAPO_CONTAINER_MOUNTS": "/lustre:/lustre,/scratch/hf:/hf", "STAPO_SLURM_JOB_DIR": "/lustre/stapo/jobs",
}
COMMON_ENV = {"STAPO_SLURM_PARTITION": "batch", "STAPO_HF_HOME": "/hf/home",
              # an SSH login node that does not exist: a dry run must never connect to it
              "STAPO_SLURM_HOST": "login.invalid", "STAPO_SLURM_USER": "me"}


@pytest.mark.parametrize("short, nodes, settings", [
    ("14b", 8, "overrides"), ("8b", 4, "environment"), ("1p7b", 2, "overrides")])
def test_dryrun_renders_the_sbatch_script(tmp_path, short, nodes, settings):
    """Cluster settings from run.executor.* overrides or STAPO_* variables end up in the script."""
    args = OVERRIDES if settings == "overrides" else []
    env = {**COMMON_ENV, **(ENV_SETTINGS if settings == "environment" else {})}
    code, out = nemo_run(tmp_path, f"launch/stapo_{short}.py", "--dryrun", "method=justrl", "steps=1",
                         "rollout.max_response_len=8192", "output_dir=/lustre/stapo/runs/r1", *args, env=env)
    assert code == 0, out
    script = sbatch_script(out)
    job = rf"/lustre/stapo/jobs/stapo_{short}/stapo_{short}_{ID}/stapo_{short}"
    for pattern in [
        rf"^#SBATCH --nodes={nodes}$",
        r"^#SBATCH --gpus-per-node=8$",
        r"^#SBATCH --ntasks-per-node=1$",  # one srun task per node runs torchrun
        r"^#SBATCH --account=stapo-acct$",
        r"^#SBATCH --partition=batch$",
        r"^#SBATCH --exclusive$",
        r"^#SBATCH --time=04:00:00$",
        rf"^#SBATCH --job-name=stapo-megatron\.stapo_{short}$",
        rf"^#SBATCH --output={job}/sbatch_stapo-megatron\.stapo_{short}_%j\.out$",
        rf"^srun --output {job}/log-stapo-megatron\.stapo_{short}_%j_\$\{{SLURM_RESTART_COUNT:-0\}}\.out ",
        r" --container-image nvcr\.io/nvidia/nemo:25\.09 ",
        rf" --container-mounts /lustre:/lustre,/scratch/hf:/hf,{job}:/nemo_run ",
        r" --container-workdir /nemo_run/code ",
        rf" torchrun --rdzv-backend c10d --rdzv-endpoint \$head_node_ip:29500 --rdzv-id \d+ "
        rf"--nnodes {nodes} --nproc-per-node 8 --node-rank \$SLURM_NODEID .*-m nemo_run\.core\.runners\.fdl_runner -n stapo_{short} ",
        r"^export HF_HOME=/hf/home$",
        r"^export HF_HUB_OFFLINE=1$",
        r"^export NCCL_DEBUG=WARN$",
        r"^export NCCL_NVLS_ENABLE=0$",
        r"^export TORCH_NCCL_ASYNC_ERROR_HANDLING=1$",
        r"^export CUDA_DEVICE_MAX_CONNECTIONS=1$",
        r"^export VLLM_ENABLE_V1_MULTIPROCESSING=0$",
        # the save before the time limit: Slurm warns torchrun, torchrun forwards to the ranks,
        # the failed exit requeues (stapo_megatron/trainer/preemption.py)
        r"^#SBATCH --signal=USR1@600$",
        r"^export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1$",
        r"^export PET_SHUTDOWN_TIMEOUT=600$",
        r"^export TORCHX_MAX_RETRIES=3$",
    ]:
        assert re.search(pattern, script, re.M), f"{pattern!r} not in\n{script}"
    # the task's arguments as NeMo-Run resolved them (steps=1 is the int 1, not True)
    for name, value in [("recipe", f"'qwen3_{short}'"), ("method", "'justrl'"), ("steps", "1"),
                        ("rollout", r"section\(max_response_len=8192\)")]:
        assert re.search(rf"│ {name}\s+│ {value}\s+│", out), (name, out)


def test_dryrun_marks_missing_settings(tmp_path):
    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "--dryrun", "output_dir=/lustre/stapo/runs/r1")
    assert code == 0, out
    script = sbatch_script(out)
    assert re.search(r"^#SBATCH --account='<unset:STAPO_SLURM_ACCOUNT>'$", script, re.M), script
    assert " --container-image <unset:STAPO_CONTAINER_IMAGE> " in script
    assert re.search(rf"^#SBATCH --output='<unset:STAPO_SLURM_JOB_DIR>/stapo_14b/stapo_14b_{ID}/", script, re.M)


def test_submission_without_account_is_refused(tmp_path):
    """A real submission checks the executor and the recipe before anything is submitted."""
    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "--yes", "data.train_path=/d/train.parquet",
                         env={"STAPO_CONTAINER_IMAGE": "img:1", "STAPO_SLURM_JOB_DIR": "/lustre/jobs"})
    assert code == 1, out
    assert "Error: not launched:\n- account (set STAPO_SLURM_ACCOUNT or run.executor.account=...)\n" in out
    assert "container_image" not in out and "tunnel.job_dir" not in out
    assert "recipe qwen3_14b cannot run" in out and "model.hf_dir is not set" in out
    assert "data.eval_path is not set" in out and "data.train_path is not set" not in out
    assert not (tmp_path / "nemo_run_home" / "experiments").exists()  # nothing was submitted


def test_bad_override_is_refused_before_launch(tmp_path):
    code, out = nemo_run(tmp_path, "launch/stapo_tiny.py", "stepz=1", "--yes")
    assert code == 1, out
    assert "unknown override stepz: TrainerConfig has no field 'stepz'" in out
    assert not (tmp_path / "nemo_run_home" / "experiments").exists()


@pytest.mark.parametrize("override, message", [
    ("loss.tau_pp=0.1", "unknown override loss.tau_pp: LossConfig has no field 'tau_pp' (did you mean 'tau_p'?)"),
    ("steps=many", "override steps='many': expected int, got str"),
    ("method=ppo", f"method must be one of {tuple(METHODS)}, got 'ppo'"),
])
def test_dryrun_validates_overrides_with_the_same_parser(tmp_path, override, message):
    code, out = nemo_run(tmp_path, "launch/stapo_tiny.py", "--dryrun", override)
    assert code == 1, out
    assert message in out, out


def test_dryrun_prints_and_saves_the_config_a_launch_takes_back(tmp_path):
    """--save-config writes the resolved configuration; config=PATH starts from it (overrides on top)."""
    from stapo_megatron.config.yaml_io import load_config

    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    code, out = nemo_run(tmp_path, "launch/stapo_tiny.py", "--dryrun", "steps=3", "loss.tau_p=0.01",
                         "--save-config", str(first))
    assert code == 0, out
    assert "# ---- resolved configuration (dry run) ----" in out and "    tau_p: 0.01\n" in out
    recipe, cfg, warmstart = load_config(str(first))
    assert (recipe, cfg.steps, cfg.loss.tau_p, warmstart.steps) == ("tiny", 3, 0.01, 300)

    code, out = nemo_run(tmp_path, "launch/stapo_tiny.py", "--dryrun", f"config={first}", "optim.lr=0.001",
                         f"--save-config={second}")
    assert code == 0, out
    _, again, warmstart_again = load_config(str(second))
    assert again == dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.001))
    assert warmstart_again == warmstart

    code, out = nemo_run(tmp_path, "launch/stapo_1p7b.py", "--dryrun", f"config={first}")
    assert code == 1 and "holds a configuration of recipe 'tiny', not 'qwen3_1p7b'" in out, out


def test_slurm_dryrun_needs_an_absolute_output_dir(tmp_path):
    code, out = nemo_run(tmp_path, "launch/stapo_8b.py", "--dryrun", "output_dir=runs/x")
    assert code == 1, out
    assert "output_dir 'runs/x' is relative: a Slurm job needs an absolute path" in out, out


def test_tiny_dryrun_shows_the_torchrun_command(tmp_path):
    code, out = nemo_run(tmp_path, "launch/stapo_tiny.py", "--dryrun", "steps=1")
    assert code == 0, out
    args = re.search(r"'args': \[(.*?)\]", out, re.S).group(1)
    args = re.findall(r"'([^']*)'", args)
    assert args[0] == "torchrun"
    assert args[args.index("--nnodes") + 1] == "1" and args[args.index("--nproc-per-node") + 1] == "2"
    assert args[args.index("-m") + 1] == "nemo_run.core.runners.fdl_runner"
    assert "'VLLM_ENABLE_V1_MULTIPROCESSING': '0'" in out
    assert f"'cwd': '{REPO}'" in out  # runs/demo is relative to the checkout
    assert re.search(r"│ recipe\s+│ 'tiny'\s+│", out) and re.search(r"│ steps\s+│ 1\s+│", out)


def test_compare_dryrun_resolves_its_arguments(tmp_path):
    code, out = nemo_run(tmp_path, "launch/compare_tiny.py", "--dryrun", "steps=5", "seeds=[0,1]")
    assert code == 0, out
    assert re.search(r"│ steps\s+│ 5\s+│", out) and re.search(r"│ seeds\s+│ \[0, 1\]\s+│", out), out
    # one driver process (it starts each run's torchrun itself), output next to the checkout
    assert "launcher=None" in out and "ntasks_per_node=1" in out
    assert re.search(rf"│ output_dir\s+│ '{re.escape(REPO)}/runs/compare'", out), out


LAUNCH_MAKEDIRS = """
import os

import nemo_run as run

if __name__ == "__main__":
    run.cli.main(os.makedirs, name="makedirs", default_executor=run.LocalExecutor())
"""


def test_exit_code_follows_the_local_job(tmp_path):
    """A real local job (os.makedirs in a worker process): 0 when it succeeds, 1 with the
    failed task and its log named when it raises."""
    launch = tmp_path / "makedirs.py"
    launch.write_text(LAUNCH_MAKEDIRS)
    code, out = nemo_run(tmp_path, str(launch), f"name={tmp_path / 'made'}", "--yes")
    assert code == 0, out
    assert (tmp_path / "made").is_dir()

    code, out = nemo_run(tmp_path, str(launch), "name=/proc/stapo/forbidden", "--yes")
    assert code == 1, out
    match = re.search(rf"Error: task makedirs of experiment makedirs_{ID} ended FAILED; logs: (\S+combined\.log)", out)
    assert match, out
    with open(match.group(1)) as f:
        assert "FileNotFoundError" in f.read()


def test_usage_and_missing_file(tmp_path):
    from stapo_megatron.launch import cli

    assert cli.main([]) == 2
    code, out = nemo_run(tmp_path, "launch/nope.py")
    assert code == 2 and "launch file launch/nope.py does not exist" in out


@pytest.mark.parametrize("body", [
    # a plain script: its __main__ block must not run (a dry run would otherwise execute it)
    "if __name__ == '__main__':\n    open(MARKER, 'w').write('ran')\n",
    # mentions cli.main only in a comment and a string: still not a launch file
    "# run.cli.main(fn)\ntext = 'run.cli.main'\nif __name__ == '__main__':\n    open(MARKER, 'w').write('ran')\n",
])
def test_plain_script_is_refused_without_running_it(tmp_path, capsys, body):
    from stapo_megatron.launch import cli

    marker = tmp_path / "marker"
    script = tmp_path / "plain.py"
    script.write_text(f"MARKER = {str(marker)!r}\n" + body)
    assert cli.main([str(script), "--dryrun"]) == 2
    assert (f"nemo-run: {script} is not a launch file: it never calls nemo_run.cli.main(fn, ...) (not run"
            in capsys.readouterr().err)
    assert not marker.exists()
    script.write_text("if __name__ == '__main__':\n    print(\n")
    assert cli.main([str(script)]) == 2
    assert "is not valid Python" in capsys.readouterr().err


def test_launch_files_are_recognised():
    from stapo_megatron.launch.cli import _calls_nemo_run_main

    for name in sorted(os.listdir(os.path.join(REPO, "launch"))):
        assert _calls_nemo_run_main(os.path.join(REPO, "launch", name)), name
