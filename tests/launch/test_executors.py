"""Tier a: a Slurm submission from a machine without sbatch is refused first, with the ways out
(the login node, STAPO_SLURM_HOST over SSH, --emit-sbatch)."""

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl  # noqa: E402

from stapo_megatron.launch import executors  # noqa: E402


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
