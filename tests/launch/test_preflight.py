"""The checks `nemo-run` runs before a submission, on their own (`stapo_megatron.launch.preflight`,
`paths.mount_problems`, `timing`): a model folder that is not the recipe's, sequences longer than
its positions, paths no container mount holds, and the save signal / requeue budget of the final
configuration. Real configs (`entry.build_config`) and real executors (NeMo-Run's SlurmExecutor)."""

import re

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl  # noqa: E402

from stapo_megatron.launch import executors, paths, preflight, timing  # noqa: E402
from stapo_megatron.launch.entry import build_config  # noqa: E402
from stapo_megatron.recipes import paper, step_time  # noqa: E402
from tests.helpers.launch_cli import write_hf_config  # noqa: E402


def config(size, **overrides):
    return build_config(size, check_paths=False, **overrides)[0]


def test_the_recipes_own_folder_passes(tmp_path):
    for size in paper.ARCHITECTURES:
        assert preflight.model_problems(size, config(size), write_hf_config(tmp_path / size, size)) == []


def test_a_dense_folder_for_the_moe_recipe_is_named(tmp_path):
    folder = write_hf_config(tmp_path / "dense", "qwen3_8b")
    problems = preflight.model_problems("qwen3_30b_a3b", config("qwen3_30b_a3b"), folder)
    assert ("has architectures='Qwen3ForCausalLM', but recipe qwen3_30b_a3b trains Qwen3-30B-A3B-Base "
            "(architectures='Qwen3MoeForCausalLM')") in problems[0]
    assert any("num_experts=None" in p and "(num_experts=128)" in p for p in problems), problems


def test_an_8b_folder_for_the_14b_recipe_names_every_difference(tmp_path):
    folder = write_hf_config(tmp_path / "8b", "qwen3_8b")
    problems = preflight.model_problems("qwen3_14b", config("qwen3_14b"), folder)
    assert len(problems) == 3, problems  # layers, width, heads (8 KV heads in both)
    assert "has num_hidden_layers=36, but recipe qwen3_14b trains Qwen3-14B-Base (num_hidden_layers=40)" in problems[0]
    assert "hidden_size=4096" in problems[1] and "num_attention_heads=32" in problems[2]


def test_sequences_longer_than_the_folders_positions_are_named(tmp_path):
    folder = write_hf_config(tmp_path / "short", "qwen3_8b", max_position_embeddings=16000)
    cfg = config("qwen3_8b", model={"hf_dir": folder})
    prompt, response = cfg.data.max_prompt_len, cfg.rollout.max_response_len
    problems = preflight.model_problems("qwen3_8b", cfg, folder)
    evaluation = paper.EVAL_MAX_RESPONSE_LEN
    assert problems == [
        f"data.max_prompt_len + rollout.max_response_len = {prompt} + {response} = {prompt + response} tokens "
        f"exceed max_position_embeddings=16000 of model.hf_dir {folder!r}",
        f"data.max_prompt_len + the evaluation's response limit = {prompt} + {evaluation} = {prompt + evaluation} "
        f"tokens exceed max_position_embeddings=16000 of model.hf_dir {folder!r}",
    ]
    # exactly the positions: fits
    write_hf_config(tmp_path / "short", "qwen3_8b", max_position_embeddings=prompt + evaluation)
    assert preflight.model_problems("qwen3_8b", cfg, folder) == []
    assert preflight.model_problems("qwen3_8b", cfg, str(tmp_path)) == [
        f"model.hf_dir {folder!r} has no config.json: give the folder of a Hugging Face checkpoint"]


def test_paths_outside_every_mount_are_named():
    read = [("model.hf_dir", "/lustre/models/q"), ("data.train_path", "/scratch/d.parquet"),
            ("data.eval_path", "/nemo_run/aime.jsonl"), ("config", "relative.yaml")]
    problems = paths.mount_problems(read, "/home/me/run", ["/lustre:/lustre", "/data/hf:/hf:ro"])
    assert len(problems) == 2, problems
    assert problems[0].startswith("data.train_path='/scratch/d.parquet' is not under a folder mounted into the "
                                  "container, so the job would not find it: add its folder to STAPO_CONTAINER_MOUNTS")
    assert problems[1].startswith("output_dir '/home/me/run' is not under a folder mounted into the container: "
                                  "the checkpoints would go to the container's temporary file system")
    assert "mounts now: /lustre:/lustre, /data/hf:/hf:ro" in problems[1]
    assert paths.mount_problems(read[:1], "/lustre/run", ["/lustre"]) == []


def slurm(size):
    return fdl.build(executors.paper_slurm_executor(size))


def test_signal_and_retries_follow_the_final_configuration(monkeypatch):
    """The launch file's defaults are the un-overridden recipe's; `apply_final` replaces them."""
    for name in ("STAPO_SLURM_SIGNAL_S", "STAPO_SLURM_RETRIES", "STAPO_SLURM_FAILURE_RETRIES", "STAPO_SLURM_TIME"):
        monkeypatch.delenv(name, raising=False)
    executor = slurm("qwen3_8b")
    cfg = config("qwen3_8b", steps=10, rollout={"max_response_len": 31744}, model={"context_parallel_size": 4})
    layout = paper.layout_for("qwen3_8b", cfg)
    step = step_time.estimate_step_time(paper.ARCHITECTURES["qwen3_8b"], layout, cfg)
    signal_s = step_time.signal_seconds(step)
    retries = step_time.jobs_needed(10, step, 4 * 3600, signal_s) - 1 + timing.FAILURE_RETRIES
    recipe_retries = executor.retries
    assert executor.signal != f"USR1@{signal_s}" and recipe_retries > 50  # the recipe's 3000 steps
    assert timing.report(cfg, "qwen3_8b", executor)[0].startswith("the save signal")
    timing.apply_final(executor, "qwen3_8b", cfg, given=())
    assert executor.signal == f"USR1@{signal_s}" and executor.retries == retries < 10
    assert executor.env_vars["PET_SHUTDOWN_TIMEOUT"] == str(signal_s)
    assert timing.report(cfg, "qwen3_8b", executor) == []
    # given on the command line or in the environment: kept
    executor = slurm("qwen3_8b")
    executor.signal, executor.retries = "USR1@7200", 1
    timing.apply_final(executor, "qwen3_8b", cfg, given=("signal", "retries"))
    assert (executor.signal, executor.retries) == ("USR1@7200", 1)
    monkeypatch.setenv("STAPO_SLURM_RETRIES", "2")
    timing.apply_final(executor, "qwen3_8b", cfg, given=("signal",))
    assert (executor.signal, executor.retries) == ("USR1@7200", 1)


def test_a_run_of_hundreds_of_jobs_prints_a_longer_time_limit(capsys, monkeypatch):
    monkeypatch.delenv("STAPO_SLURM_TIME", raising=False)
    executor = slurm("qwen3_8b_32k")
    cfg = config("qwen3_8b_32k")
    timing.apply_final(executor, "qwen3_8b_32k", cfg, given=())
    assert timing.report(cfg, "qwen3_8b_32k", executor) == []
    out = capsys.readouterr().out
    hint = [line for line in out.splitlines() if line.startswith("# hint:")]
    assert len(hint) == 1 and "STAPO_SLURM_TIME=24:00:00" in hint[0], out
    jobs, longer = (int(n) for n in re.search(r"~(\d+) jobs of 04:00:00.*needs ~(\d+)$", hint[0]).groups())
    assert jobs > timing.MANY_JOBS and longer < jobs / 5, hint


# ---- through the `nemo-run` command (slow: 10-30 s of imports each) ----


def test_a_submission_from_a_machine_without_sbatch_is_refused_first(tmp_path, monkeypatch):
    """Submitting on this machine (no STAPO_SLURM_HOST) needs sbatch here: NeMo-Run failed only
    after creating the experiment, with "Unexpected error ... sbatch: command not found"."""
    monkeypatch.delenv("STAPO_SLURM_HOST", raising=False)
    executor, local = fdl.build(executors.slurm_executor(nodes=1)), fdl.build(executors.local_executor())
    monkeypatch.setenv("STAPO_SLURM_HOST", "login.invalid")  # over SSH: the login node's sbatch
    over_ssh = fdl.build(executors.slurm_executor(nodes=1))
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without Slurm's commands
    assert executors.missing_sbatch(executor) == [
        "sbatch is not on this machine's PATH: run nemo-run on the cluster's login node, set STAPO_SLURM_HOST "
        "(and STAPO_SLURM_USER) to submit over SSH, or write a script with --emit-sbatch and submit it there"]
    sbatch = tmp_path / "sbatch"
    sbatch.write_text("#!/bin/sh\n")
    sbatch.chmod(0o755)
    assert executors.missing_sbatch(executor) == []
    sbatch.unlink()
    assert executors.missing_sbatch(over_ssh) == [] and executors.missing_sbatch(local) == []
