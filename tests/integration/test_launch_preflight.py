"""The checks `nemo-run` runs before a submission (`stapo_megatron.launch.preflight`), through the
command: the end-to-end tests (the single-process ones are in ``tests/launch/test_preflight.py``,
``test_paths.py`` and ``test_timing.py``)."""

import pytest
from tests.helpers.launch_cli import write_hf_config


SLURM = ["run.executor.account=a", "run.executor.container_image=img", "run.executor.tunnel.job_dir=/lustre/jobs"]


@pytest.mark.slow
def test_dryrun_names_every_path_no_container_mount_holds(tmp_path):
    """A dry run with every path on a shared file system and no mounts: each one named."""
    from tests.helpers.launch_cli import nemo_run, sbatch_script

    shared = [f"{key}=/shared/stapo/{key}" for key in ("model.hf_dir", "model.megatron_ckpt", "data.train_path",
                                                       "data.eval_path")]
    code, out = nemo_run(tmp_path, "launch/stapo_8b.py", "--dryrun", "output_dir=/shared/stapo/run", *shared, *SLURM)
    assert code == 0 and sbatch_script(out), out
    refused = out.split("# ---- a submission would be refused")[1]
    for key in ("model.hf_dir", "model.megatron_ckpt", "data.train_path", "data.eval_path"):
        assert f"- {key}='/shared/stapo/{key}' is not under a folder mounted into the container" in refused, key
    assert "- output_dir '/shared/stapo/run' is not under a folder mounted into the container: the checkpoints" in refused
    code, out = nemo_run(tmp_path, "launch/stapo_8b.py", "--dryrun", "output_dir=/shared/stapo/run", *shared, *SLURM,
                         "run.executor.container_mounts=['/shared:/shared']")
    assert code == 0 and "mounted into the container" not in out, out


@pytest.mark.slow
def test_signal_and_budget_come_from_the_overridden_and_loaded_configuration(tmp_path):
    """A given 300 s signal is refused as shorter than the overridden step; a saved
    config with steps=10 printed the recipe's 3000-step budget."""
    from tests.helpers.launch_cli import nemo_run, paper_signal_and_retries, sbatch_script

    longer = ["rollout.max_response_len=31744", "model.context_parallel_size=4"]
    code, out = nemo_run(tmp_path, "launch/stapo_8b.py", "--dryrun", "output_dir=/lustre/r", *longer,
                         f"--save-config={tmp_path}/run.yaml")
    assert code == 0 and "- the save signal" not in out, out
    signal_s, retries = paper_signal_and_retries("qwen3_8b", rollout={"max_response_len": 31744},
                                                 model={"context_parallel_size": 4})
    script = sbatch_script(out)
    assert f"#SBATCH --signal=USR1@{signal_s}\n" in script and f"export PET_SHUTDOWN_TIMEOUT={signal_s}\n" in script
    assert f"export TORCHX_MAX_RETRIES={retries}\n" in script
    code, out = nemo_run(tmp_path, "launch/stapo_8b.py", "--dryrun", f"config={tmp_path}/run.yaml", "steps=10")
    assert code == 0, out
    signal_s, retries = paper_signal_and_retries("qwen3_8b", steps=10, rollout={"max_response_len": 31744},
                                                 model={"context_parallel_size": 4})
    assert f"save signal {signal_s} s before it: ~{retries - 4} jobs; retries={retries} " in out, out
    # given on the command line: kept, and checked
    code, out = nemo_run(tmp_path, "launch/stapo_8b.py", "--dryrun", "output_dir=/lustre/r", *longer,
                         "run.executor.signal=USR1@300", "run.executor.retries=3")
    assert code == 0 and "- the save signal 300 s before the time limit is shorter than one step" in out, out


@pytest.mark.slow
def test_emit_sbatch_lists_every_problem_at_once(tmp_path):
    """A dense 8B folder for the MoE recipe, no eval_path and a missing train file: all named in
    one refusal (before, only the missing eval_path was)."""
    from tests.helpers.launch_cli import nemo_run

    model = write_hf_config(tmp_path / "model", "qwen3_8b")
    (tmp_path / "ckpt").mkdir()
    code, out = nemo_run(tmp_path, "launch/stapo_30b_a3b.py", "--emit-sbatch", str(tmp_path / "job.sh"),
                         f"output_dir={tmp_path}/run", f"model.hf_dir={model}", f"model.megatron_ckpt={tmp_path}/ckpt",
                         f"data.train_path={tmp_path}/train.jsonl")
    assert code == 1 and not (tmp_path / "job.sh").exists(), out
    refused = out.split("no script written:")[1]
    assert "data.eval_path is not set" in refused
    assert f"data.train_path='{tmp_path}/train.jsonl' does not exist" in refused
    assert "has architectures='Qwen3ForCausalLM', but recipe qwen3_30b_a3b trains Qwen3-30B-A3B-Base" in refused
    assert "has num_hidden_layers=36" in refused and "(num_experts=128)" in refused


@pytest.mark.slow
def test_a_layout_tp_cannot_split_is_named_before_the_missing_cluster(tmp_path):
    """TP=3 on Qwen3-14B was refused for the missing Slurm settings and sbatch, and for a token
    budget, without naming the heads TP=3 cannot divide: now one list, the recipe's problems first."""
    from tests.helpers.launch_cli import nemo_run

    code, out = nemo_run(tmp_path, "launch/stapo_14b.py", "model.tensor_model_parallel_size=3")
    assert code == 1, out
    listed = out.split("Error: not launched:\n")[1]
    assert listed.startswith("- recipe qwen3_14b cannot run:\n"
                             "  - num_attention_heads 40 is not divisible by tensor_model_parallel_size 3\n"
                             "  - num_query_groups 8 is not divisible by tensor_model_parallel_size 3\n"), out
    assert "  - 64 GPUs are not divisible by TP 3 x PP 1 x CP 4\n" in listed
    environment = listed.index("- account (set STAPO_SLURM_ACCOUNT or run.executor.account=...)\n")
    assert listed.index("  - data.eval_path is not set") < environment
    assert "- tunnel.job_dir (set STAPO_SLURM_JOB_DIR" in listed[environment:]


@pytest.mark.slow
@pytest.mark.parametrize("launch, argument, message", [
    ("stapo_tiny", "run_dir=/x", "nemo-run: unknown setting 'run_dir'; the run's folder is output_dir=/x."),
    ("stapo_14b", "run.executor.nodes=abc", "Error: run.executor.nodes expects an integer, got 'abc'\n"),
])
def test_a_misread_argument_is_named_in_one_sentence(tmp_path, launch, argument, message):
    """NeMo-Run's own messages: "Run overwrites must start with 'run.'", and a parse error
    repeating 'abc' with its context dict."""
    from tests.helpers.launch_cli import nemo_run

    code, out = nemo_run(tmp_path, f"launch/{launch}.py", argument, "--dryrun")
    assert code == (2 if launch == "stapo_tiny" else 1), out
    assert message in out
    assert "Context" not in out and "overwrites must start" not in out and "Traceback" not in out
