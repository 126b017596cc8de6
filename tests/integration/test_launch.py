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
from stapo_megatron.recipes import paper
from tests.helpers import REPO_DIR
from tests.helpers.launch_cli import NEMO_RUN, nemo_run, paper_signal_and_retries, sbatch_script

REPO = REPO_DIR
ID = r"\d+"  # NeMo-Run experiment ids end in time.time_ns()

pytest.importorskip("nemo_run")
# every test starts the `nemo-run` command (10-30 s of imports each): the slow tier
pytestmark = pytest.mark.slow


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
    ("14b", 8, "overrides"), ("8b", 4, "environment"), ("1p7b", 2, "overrides"), ("30b_a3b", 4, "overrides")])
def test_dryrun_renders_the_sbatch_script(tmp_path, short, nodes, settings):
    """Cluster settings from run.executor.* overrides or STAPO_* variables end up in the script."""
    args = OVERRIDES if settings == "overrides" else []
    env = {**COMMON_ENV, **(ENV_SETTINGS if settings == "environment" else {})}
    code, out = nemo_run(tmp_path, f"launch/stapo_{short}.py", "--dryrun", "method=justrl", "steps=1",
                         "rollout.max_response_len=8192", "output_dir=/lustre/stapo/runs/r1", *args, env=env)
    assert code == 0, out
    script = sbatch_script(out)
    job = rf"/lustre/stapo/jobs/stapo_{short}/stapo_{short}_{ID}/stapo_{short}"
    signal_s, retries = paper_signal_and_retries(f"qwen3_{short}", steps=1, rollout={"max_response_len": 8192})
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
        rf"^#SBATCH --signal=USR1@{signal_s}$",
        r"^export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1$",
        rf"^export PET_SHUTDOWN_TIMEOUT={signal_s}$",
        rf"^export TORCHX_MAX_RETRIES={retries}$",
        # NeMo-Run's requeue on any failure is off; the EXIT trap requeues what can progress
        r"^stapo_budget=\$TORCHX_MAX_RETRIES\nexport TORCHX_MAX_RETRIES=0 ",
        r"^stapo_run_dir=/lustre/stapo/runs/r1$",
        r"^stapo_before_attempt\ntrap 'stapo_after_attempt \$\?' EXIT$",
    ]:
        assert re.search(pattern, script, re.M), f"{pattern!r} not in\n{script}"
    # the task's arguments as NeMo-Run resolved them (steps=1 is the int 1, not True)
    for name, value in [("recipe", f"'qwen3_{short}'"), ("method", "'justrl'"), ("steps", "1")]:
        assert re.search(rf"│ {name}\s+│ {value}\s+│", out), (name, out)
    # the rollout section: the override beside its mode sections (empty, for nested overrides)
    rollout = out[out.index("│ rollout"):out.index("└", out.index("│ rollout"))]
    assert "max_response_len=8192)" in rollout and "streaming=section()" in rollout, rollout


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
    assert "Error: not launched:\n- recipe qwen3_14b cannot run:\n" in out  # the recipe's problems first
    assert "\n- account (set STAPO_SLURM_ACCOUNT or run.executor.account=...)\n" in out
    assert "container_image" not in out and "tunnel.job_dir" not in out
    assert "model.hf_dir is not set" in out
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
    # packing=padded: a mode name NeMo-Run's parser keeps as text (it reads "off" as False)
    code, out = nemo_run(tmp_path, "launch/stapo_tiny.py", "--dryrun", "steps=3", "loss.tau_p=0.01",
                         "packing=padded", "--save-config", str(first))
    assert code == 0, out
    assert "# ---- resolved configuration (dry run) ----" in out and "    tau_p: 0.01\n" in out
    recipe, cfg, warmstart = load_config(str(first))
    assert (recipe, cfg.steps, cfg.loss.tau_p, cfg.packing, warmstart.steps) == ("tiny", 3, 0.01, "padded", 250)

    code, out = nemo_run(tmp_path, "launch/stapo_tiny.py", "--dryrun", f"config={first}", "optim.lr=0.001",
                         f"--save-config={second}")
    assert code == 0, out
    _, again, warmstart_again = load_config(str(second))
    assert again == dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.001))
    assert warmstart_again == warmstart

    code, out = nemo_run(tmp_path, "launch/stapo_1p7b.py", "--dryrun", f"config={first}")
    assert code == 1 and "holds a configuration of recipe 'tiny', not 'qwen3_1p7b'" in out, out


SUBMIT = ["run.executor.account=a", "run.executor.container_image=img", "run.executor.tunnel.job_dir=/lustre/jobs"]


def test_slurm_output_dir_is_refused_at_submission_not_in_the_dry_run(tmp_path):
    """A dry run renders the job (a relative output_dir listed as a problem); a submission refuses it."""
    code, out = nemo_run(tmp_path, "launch/stapo_8b.py", "--dryrun", "output_dir=runs/x")
    assert code == 0, out
    assert "# ---- a submission would be refused (dry run" in out and sbatch_script(out)
    assert "output_dir 'runs/x' is relative: a Slurm job needs an absolute path" in out, out
    files = [f"{k}=/nonexistent/{k}" for k in ("model.hf_dir", "model.megatron_ckpt", "data.train_path",
                                                "data.eval_path")]
    home = tmp_path / "submission"
    code, out = nemo_run(home, "launch/stapo_8b.py", "--yes", "output_dir=runs/x", *files, *SUBMIT)
    assert code == 1, out
    assert "output_dir 'runs/x' is relative: a Slurm job needs an absolute path" in out, out
    assert not (home / "nemo_run_home" / "experiments").exists()


# the layout line of each paper dry run: its parallel sizes as recipes/paper.py sets them
LAYOUT_LINES = {
    "14b": r"# 8 x 8 GPUs: TP=4 PP=1 CP=4 DP=4; 16384-token sequences \(4096 per CP rank\), recompute none; "
           r"vLLM TP=4 at 0\.35 of the card; [\d.]+ GB training \+ [\d.]+ GB vLLM = [\d.]+ GB of 80 GB",
    "8b": r"# 4 x 8 GPUs: TP=4 PP=1 CP=2 DP=4; 16384-token sequences \(8192 per CP rank\), recompute none;",
    "8b_32k": r"# 4 x 8 GPUs: TP=4 PP=1 CP=4 DP=2; 32768-token sequences \(8192 per CP rank\), recompute none;",
    "1p7b": r"# 2 x 8 GPUs: TP=2 PP=1 CP=1 DP=8; 16384-token sequences \(16384 per CP rank\), recompute full;",
    "30b_a3b": r"# 4 x 8 GPUs: TP=4 PP=1 CP=1 EP=16 ETP=1 DP=8; 16384-token sequences \(16384 per CP rank\), "
               r"recompute full; vLLM TP=4 at 0\.4 of the card;",
    # separate placement: both pools
    "8b_async": r"# 4 x 8 GPUs, separate placement: 16 train \(TP=4 PP=1 CP=2 DP=2; 16384-token sequences, recompute "
                r"none; [\d.]+ GB of 80 GB\), 16 generate \(4 vLLM engines of TP=4 at 0\.85 of the card, 1\.9 GB of "
                r"weight buckets beside it: KV cache for "
                r"\d+ tokens per GPU\)",
}


@pytest.mark.parametrize("short", sorted(LAYOUT_LINES))
def test_documented_paper_dryrun_renders_with_a_placeholder_output_dir(tmp_path, short):
    """`nemo-run launch/stapo_14b.py --dryrun`, as the docs and the launch files write it: the
    script, the layout with CP / EP and the memory estimate, the step time."""
    code, out = nemo_run(tmp_path, f"launch/stapo_{short}.py", "--dryrun")
    assert code == 0, out
    assert "run_dir: <unset:output_dir>" in out
    assert re.search(r"│ output_dir\s+│ '<unset:output_dir>'\s+│", out) and sbatch_script(out)
    assert "- output_dir is not set: give an absolute path on a shared file system" in out
    assert re.search(r"^# ---- layout and memory per GPU .*\n" + LAYOUT_LINES[short], out, re.M), out
    assert re.search(r"# one step ~\d+\.\d min \(rollout", out), out


def test_env_var_overrides_merge_with_the_recipe_environment(tmp_path):
    """Both forms add variables; none of the recipe's (the save signal's PET_* among them) is lost."""
    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "--dryrun", "output_dir=/lustre/r",
                         "run.executor.env_vars.NCCL_IB_HCA=mlx5", "run.executor.env_vars={'NCCL_SOCKET_IFNAME': 'ib0'}",
                         "run.executor.env_vars.NCCL_DEBUG=INFO")
    assert code == 0, out
    script = sbatch_script(out)
    for line in ["NCCL_IB_HCA=mlx5", "NCCL_SOCKET_IFNAME=ib0", "NCCL_DEBUG=INFO", "HF_HUB_OFFLINE=1",
                 "PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "CUDA_DEVICE_MAX_CONNECTIONS=1",
                 "VLLM_ENABLE_V1_MULTIPROCESSING=0", "PET_RDZV_CONF=join_timeout=300"]:
        assert re.search(rf"^export {re.escape(line)}$", script, re.M), (line, script)
    assert "NCCL_DEBUG=WARN" not in script


def test_submission_checks_every_path_on_the_login_node(tmp_path):
    model, ckpt = tmp_path / "model", tmp_path / "ckpt"
    model.mkdir()
    ckpt.mkdir()
    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "--yes", f"output_dir={tmp_path}/run", *SUBMIT,
                         f"run.executor.container_mounts=['{tmp_path}:{tmp_path}']",
                         "model.hf_dir=Qwen/Qwen3-14B-Base", f"model.megatron_ckpt={ckpt}",
                         "data.train_path=data/dapo.parquet", f"data.eval_path={tmp_path}/aime24.jsonl")
    assert code == 1, out
    assert "model.hf_dir='Qwen/Qwen3-14B-Base' is a hub id, but the job runs with HF_HUB_OFFLINE=1" in out
    assert "data.train_path='data/dapo.parquet' is relative" in out
    assert f"data.eval_path='{tmp_path}/aime24.jsonl' does not exist" in out
    assert "model.megatron_ckpt" not in out.split("not launched:")[1]
    assert not (tmp_path / "nemo_run_home" / "experiments").exists()
    # a path inside the container is looked up at the mount's source
    (tmp_path / "aime24.jsonl").write_text("{}\n")
    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "--yes", "output_dir=/data/run", *SUBMIT,
                         f"run.executor.container_mounts=['{tmp_path}:/data']", f"model.hf_dir={model}",
                         f"model.megatron_ckpt={ckpt}", "data.train_path=/data/train.parquet",
                         "data.eval_path=/data/aime24.jsonl")
    assert code == 1, out
    assert f"data.train_path='/data/train.parquet' does not exist (outside the container: {tmp_path}/train.parquet)" in out
    assert "aime24" not in out.split("not launched:")[1]


def test_tiny_async_dryrun_starts_the_engine_rank_too(tmp_path):
    """`make demo-async`: three processes, the last the engine (rollout.separate.engine_ranks=1)."""
    code, out = nemo_run(tmp_path, "launch/stapo_tiny_async.py", "--dryrun", f"output_dir={tmp_path}/fresh-run")
    assert code == 0, out
    args = re.findall(r"'([^']*)'", re.search(r"'args': \[(.*?)\]", out, re.S).group(1))
    assert args[args.index("--nproc-per-node") + 1] == "3"
    assert re.search(r"mode: separate", out) and re.search(r"engine_ranks: 1", out) and "max_staleness: 1" in out
    assert re.search(r"rollout_correction:\s+mode: tis", out), out  # stale samples corrected by default
    code, out = nemo_run(tmp_path, "launch/stapo_tiny_async.py", "--dryrun", f"output_dir={tmp_path}/fresh-run",
                         "loss.rollout_correction.mode='none'")
    assert code == 0 and "rollout.separate.max_staleness=1 with loss.rollout_correction.mode='none'" in out, out


def test_streaming_dryrun_takes_the_correction_settings(tmp_path):
    """The correction's own section through the whole command (every recipe launch file's task:
    tests/launch/test_executors.py): the resolved configuration and the sbatch script's task
    carry both fields."""
    code, out = nemo_run(tmp_path, "launch/stapo_8b_stream.py", "loss.rollout_correction.mode=none",
                         "loss.rollout_correction.tis_cap=3.0", "--dryrun", env=ENV_SETTINGS)
    assert code == 0, out
    assert re.search(r"rollout_correction:\s+mode: none\s+tis_cap: 3.0", out), out
    assert f"rollout.separate.max_staleness={paper.STREAM_STALENESS} with loss.rollout_correction.mode='none'" in out


def test_tiny_dryrun_shows_the_torchrun_command(tmp_path):
    code, out = nemo_run(tmp_path, "launch/stapo_tiny.py", "--dryrun", "steps=1", f"output_dir={tmp_path}/fresh-run")
    assert code == 0, out
    args = re.search(r"'args': \[(.*?)\]", out, re.S).group(1)
    args = re.findall(r"'([^']*)'", args)
    assert args[0] == "torchrun"
    assert args[args.index("--nnodes") + 1] == "1" and args[args.index("--nproc-per-node") + 1] == "2"
    assert args[args.index("-m") + 1] == "nemo_run.core.runners.fdl_runner"
    assert "'VLLM_ENABLE_V1_MULTIPROCESSING': '0'" in out
    assert f"'cwd': '{REPO}'" in out  # runs/demo is relative to the checkout
    # the tiny recipe's model folder is written by the job, not read: a fresh output folder (what
    # `make demo` on a fresh clone has) is no problem for the login-node path check
    assert "a submission would be refused" not in out, out
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
    from stapo_megatron.launch.cli import calls_nemo_run_main

    for name in sorted(os.listdir(os.path.join(REPO, "launch"))):
        assert calls_nemo_run_main(os.path.join(REPO, "launch", name)), name


# ---- the code a job runs, from any directory; plain sbatch + torchrun ----

def _git_checkout(path):
    """A git checkout with one commit, one edited file and one new file (a custom reward module)."""
    def git(*args):
        subprocess.run(["git", "-C", str(path), *args], check=True, capture_output=True,
                       env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"})
    path.mkdir()
    git("init", "-q")
    (path / "reward.py").write_text("VALUE = 1\n")
    (path / ".gitignore").write_text("*.log\n")
    git("add", "-A")
    git("commit", "-q", "-m", "first")
    (path / "reward.py").write_text("VALUE = 2\n")
    (path / "my_reward.py").write_text("def reward(): ...\n")
    (path / "ignored.log").write_text("not shipped\n")
    return git


def test_dryrun_from_outside_the_checkout(tmp_path):
    """NeMo-Run's Slurm packaging runs `git rev-parse` in the working directory: a raw error before."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_")}
    environ.update(NEMORUN_HOME=str(tmp_path / "home"), COLUMNS="250")
    proc = subprocess.run([NEMO_RUN, os.path.join(REPO, "launch", "stapo_8b.py"), "--dryrun", "output_dir=/lustre/r"],
                          cwd=outside, env=environ, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert sbatch_script(out) and "rev-parse" not in out


def test_submission_with_uncommitted_changes_is_refused_naming_them(tmp_path):
    checkout = tmp_path / "checkout"
    _git_checkout(checkout)
    for name in ("model", "ckpt"):
        (tmp_path / name).mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text("{}\n")
    code, out = nemo_run(tmp_path, "launch/stapo_1p7b.py", "--yes", f"output_dir={tmp_path}/run", *SUBMIT,
                         f"model.hf_dir={tmp_path}/model", f"model.megatron_ckpt={tmp_path}/ckpt",
                         f"data.train_path={tmp_path}/train.jsonl", f"data.eval_path={tmp_path}/eval.jsonl",
                         env={"STAPO_CODE_DIR": str(checkout)})
    assert code == 1, out
    refused = out.split("not launched:")[1]
    assert (f"2 uncommitted changes in {checkout} would not reach the job (it runs git archive of HEAD): "
            "M reward.py; ?? my_reward.py. Commit them, or add --include-uncommitted") in refused, out
    assert "ignored.log" not in refused
    assert not (tmp_path / "nemo_run_home" / "experiments").exists()


def test_include_uncommitted_ships_the_working_tree(tmp_path):
    """The snapshot commit, archived by NeMo-Run's own GitArchivePackager, holds the files on disk;
    the checkout's branch, index and status are unchanged."""
    import tarfile

    from stapo_megatron.launch import shipping

    checkout = tmp_path / "checkout"
    _git_checkout(checkout)
    status = shipping.uncommitted_files(str(checkout))
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    assert sorted(status) == [" M reward.py", "?? my_reward.py"]
    ref = shipping.snapshot_commit(str(checkout))
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    # packaged in a process of its own (invoke, which NeMo-Run's packager runs git with, reads stdin)
    code = ("import sys, nemo_run as run; print(run.GitArchivePackager(basepath=sys.argv[1], ref=sys.argv[2])"
            ".package(sys.argv[3], sys.argv[4], 'code'))")
    archive = subprocess.run([sys.executable, "-c", code, str(checkout), ref, str(tmp_path), str(jobs)],
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, check=True,
                             cwd=tmp_path).stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as tar:
        names = {n.removeprefix("./") for n in tar.getnames()}
        assert {"reward.py", "my_reward.py", ".gitignore"} <= names and "ignored.log" not in names
        member = next(m for m in tar.getmembers() if m.name.removeprefix("./") == "reward.py")
        assert tar.extractfile(member).read() == b"VALUE = 2\n"
    assert shipping.uncommitted_files(str(checkout)) == status
    assert subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout == head


def test_emit_sbatch_writes_a_plain_torchrun_script(tmp_path):
    from stapo_megatron.launch.entry import parse_arguments

    from tests.helpers.launch_cli import write_hf_config

    write_hf_config(tmp_path / "model", "qwen3_14b")
    (tmp_path / "ckpt").mkdir()
    for name in ("train.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text("{}\n")
    overrides = [f"output_dir={tmp_path}/run", f"model.hf_dir={tmp_path}/model",
                 f"model.megatron_ckpt={tmp_path}/ckpt", f"data.train_path={tmp_path}/train.jsonl",
                 f"data.eval_path={tmp_path}/eval.jsonl", "method=justrl", "rollout.max_response_len=8192"]
    script_path = tmp_path / "job.sh"
    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "--emit-sbatch", str(script_path), *overrides,
                         "run.executor.account=acct", "run.executor.env_vars.NCCL_IB_HCA=mlx5")
    assert code == 0, out
    script = script_path.read_text()
    assert subprocess.run(["bash", "-n", str(script_path)]).returncode == 0
    signal_s, retries = paper_signal_and_retries("qwen3_14b", rollout={"max_response_len": 8192})
    for line in ["#SBATCH --nodes=8", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=1",
                 f"#SBATCH --signal=USR1@{signal_s}", "#SBATCH --account=acct", "#SBATCH --requeue",
                 f"cd {REPO}", "export NCCL_IB_HCA=mlx5", "export HF_HUB_OFFLINE=1",
                 "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]:
        assert re.search(rf"^{re.escape(line)}$", script, re.M), (line, script)
    assert f"stapo_retries={retries}" in script and f"stapo_run_dir={tmp_path}/run" in script
    assert 'stapo_after_attempt "$code"' in script and "HF_HOME" not in script
    command = re.search(r"^srun --kill-on-bad-exit=1 torchrun (.*?)\ncode=", script, re.M | re.S).group(1)
    words = command.replace("\\\n", " ").split()
    assert "--nproc-per-node=8" in words
    start = words.index("stapo_megatron.launch.entry")
    assert words[start - 1] == "-m" and words[start + 1] == "qwen3_14b"
    assert parse_arguments(words[start + 2:]) == parse_arguments(overrides)
    # checked like a submission: a missing path writes nothing
    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "--emit-sbatch", str(tmp_path / "no.sh"), *overrides[:-3],
                         f"data.eval_path={tmp_path}/missing.jsonl")
    assert code == 1 and f"data.eval_path='{tmp_path}/missing.jsonl' does not exist" in out, out
    assert not (tmp_path / "no.sh").exists()


def test_help_lists_the_launch_files_and_the_added_options(tmp_path):
    code, out = nemo_run(tmp_path, "--help")
    assert code == 0, out
    assert re.search(r"^  launch/stapo_14b\.py\s+STAPO on Qwen3-14B-Base", out, re.M), out
    assert re.search(r"^  launch/stapo_tiny\.py\s+The embedded default main job", out, re.M)
    for text in ("--save-config PATH", "--emit-sbatch PATH", "--include-uncommitted", "method=NAME",
                 "SECTION.FIELD=VALUE", "docs/config-reference.md", "-y, --yes"):
        assert text in out, text
    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "--help")
    assert code == 0 and "--save-config PATH" in out and "method=NAME" in out and "--dryrun" in out, out


def _quickstart_steps(first: int, last: int) -> str:
    """The "Cluster quickstart (Slurm)" shell block of docs/launching.md, steps ``first`` to ``last``."""
    with open(os.path.join(REPO, "docs", "launching.md"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"```bash\n(# 1\. convert the base model.*?)```", text, re.S).group(1)
    steps = re.split(r"^(?=# \d\. )", block, flags=re.M)
    return "".join(s for s in steps if s and first <= int(s[2]) <= last)


def test_the_docs_quickstart_saves_a_config_its_launch_takes(tmp_path):
    """Steps 2 and 3 of the cluster quickstart in docs/launching.md, as written (the shared file system /lustre
    a temporary folder, the submission a dry run): the saved configuration is launched back
    without a problem. It once saved into the checkout (`--save-config qwen3-14b-stapo.yaml`),
    and the launch then refused the relative config path and the checkout's new file."""
    from tests.helpers.launch_cli import write_hf_config

    lustre = tmp_path / "lustre"
    write_hf_config(lustre / "models" / "Qwen3-14B-Base", "qwen3_14b")
    (lustre / "ckpt" / "qwen3-14b").mkdir(parents=True)
    (lustre / "data").mkdir()
    for name in ("dapo-math-17k.parquet", "heldout.jsonl"):
        (lustre / "data" / name).write_text("{}\n")
    code_dir = tmp_path / "code"  # a clean checkout: the job's code, whatever state this one is in
    _git_checkout(code_dir)("commit", "-qam", "clean")
    subprocess.run(["git", "-C", str(code_dir), "clean", "-fdq"], check=True)
    script = _quickstart_steps(2, 3).replace("/lustre", str(lustre)).replace("--yes --detach", "--dryrun")
    assert script.count("nemo-run launch/stapo_14b.py") == 2, script
    script = script.replace("nemo-run ", f"{NEMO_RUN} ")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_")}
    environ.update(NEMORUN_HOME=str(tmp_path / "home"), COLUMNS="250", STAPO_CODE_DIR=str(code_dir))
    proc = subprocess.run(["bash", "-ec", script], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("# ---- sbatch script of task stapo_14b") == 2, out
    assert "a submission would be refused" not in out, out
    saved = re.search(r"wrote the resolved configuration to (\S+) ", out).group(1)
    assert saved.startswith(str(lustre) + "/"), saved  # on the shared file system, not in the checkout
