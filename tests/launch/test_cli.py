"""Tier a: the messages of ``nemo-run`` (`stapo_megatron.launch.cli`) that need no job: why
``--emit-sbatch`` writes nothing for a launch file, and which launch files it does write."""

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl  # noqa: E402
import nemo_run as run  # noqa: E402

from stapo_megatron.launch import cli, executors  # noqa: E402
from tests.helpers.launch_cli import PAPER_FILES  # noqa: E402


def test_emit_sbatch_refusal_of_a_local_launch_file_names_every_paper_file():
    """The message listed three of the five paper launch files and did not say why (issue 36's
    new-user pass: `nemo-run launch/stapo_tiny.py --emit-sbatch job.sh`)."""
    message = cli.emit_sbatch_refusal(fdl.build(executors.local_executor(nproc_per_node=2)), is_recipe=True)
    assert "this launch file runs a recipe on LocalExecutor (this machine: run it with --yes" in message
    assert message.endswith("The paper recipes' launch files: " + ", ".join(sorted(PAPER_FILES)))
    message = cli.emit_sbatch_refusal(run.SlurmExecutor(account="a"), is_recipe=False)
    assert "this launch file does not run a recipe (`entry.run_recipe`) on SlurmExecutor." in message
