"""Tier a: a Slurm submission from a machine without sbatch is refused first, with the ways out
(the login node, STAPO_SLURM_HOST over SSH, --emit-sbatch); every recipe launch file takes a
nested section's overrides (``loss.rollout_correction.*``) through NeMo-Run's own parser."""

import os

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl  # noqa: E402

from nemo_run.cli.cli_parser import parse_cli_args  # noqa: E402

from stapo_megatron.launch import entry, executors  # noqa: E402
from stapo_megatron.launch.arguments import load_entrypoint  # noqa: E402
from tests.helpers import REPO_DIR  # noqa: E402

RECIPE_LAUNCH_FILES = sorted(f"launch/{name}" for name in os.listdir(os.path.join(REPO_DIR, "launch"))
                             if "executors.recipe_task(" in open(os.path.join(REPO_DIR, "launch", name)).read())
"""The launch files whose task is a recipe's (`executors.recipe_task`): each has the correction."""
CORRECTION = ("loss.rollout_correction.mode=none", "loss.rollout_correction.tis_cap=3.0")


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


def test_every_recipe_launch_file_is_found():
    assert len(RECIPE_LAUNCH_FILES) == 16 and "launch/stapo_8b_stream.py" in RECIPE_LAUNCH_FILES
    assert {"launch/stapo_qwen35_27b.py", "launch/stapo_qwen35_35b_a3b.py"} <= set(RECIPE_LAUNCH_FILES)
    assert {"launch/stapo_14b_lora.py", "launch/stapo_32b_lora.py", "launch/stapo_tiny_lora.py"} <= set(RECIPE_LAUNCH_FILES)
    assert "launch/stapo_tiny_qwen35.py" in RECIPE_LAUNCH_FILES


@pytest.mark.parametrize("path", RECIPE_LAUNCH_FILES)
def test_the_correction_is_overridable_on_every_recipe_launch_file(path):
    """``loss.rollout_correction.FIELD=VALUE`` walks NeMo-Run's task through the loss section to
    its own section; the configuration the worker builds, and the command line a plain sbatch
    script passes on, take it (NeMo-Run refused it: "Invalid attribute 'rollout_correction'")."""
    task = load_entrypoint(os.path.join(REPO_DIR, path)).default_factory()
    kwargs = dict(fdl.build(parse_cli_args(task, list(CORRECTION))).keywords)
    assert kwargs["loss"]["rollout_correction"] == {"mode": None, "tis_cap": 3.0}  # none: NeMo-Run's None
    assert [t for t in entry.format_arguments(kwargs) if "rollout_correction" in t] == [
        "loss.rollout_correction.mode=None", "loss.rollout_correction.tis_cap=3.0"]
    for arguments in (kwargs, {"recipe": kwargs["recipe"], **entry.parse_arguments(entry.format_arguments(kwargs))}):
        cfg, _ = entry.build_config(check_paths=False, **arguments)
        assert (cfg.loss.rollout_correction.mode, cfg.loss.rollout_correction.tis_cap) == ("none", 3.0)


def test_a_launch_file_keeps_its_own_section_settings_beside_the_nested_ones():
    """stapo_tiny_async.py sets ``loss.rollout_correction.mode=tis`` in its task: an override of
    another field of that section keeps it, and an override of the same field replaces it."""
    factory = load_entrypoint(os.path.join(REPO_DIR, "launch/stapo_tiny_async.py")).default_factory
    kwargs = dict(fdl.build(parse_cli_args(factory(), ["loss.rollout_correction.tis_cap=3.0"])).keywords)
    assert kwargs["loss"] == {"rollout_correction": {"mode": "tis", "tis_cap": 3.0}}
    assert kwargs["model"] == {} and kwargs["rollout"]["separate"]["max_staleness"] == 1
    kwargs = dict(fdl.build(parse_cli_args(factory(), ["loss.rollout_correction.mode=icepop"])).keywords)
    assert kwargs["loss"]["rollout_correction"] == {"mode": "icepop"}
