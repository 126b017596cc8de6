"""Tier a: the messages of ``nemo-run`` (`stapo_megatron.launch.cli`) that need no job: why
``--emit-sbatch`` writes nothing for a launch file, and which launch files it does write."""

import os

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl  # noqa: E402
import nemo_run as run  # noqa: E402

from stapo_megatron.launch import arguments, cli, executors  # noqa: E402
from tests.helpers.launch_cli import PAPER_FILES  # noqa: E402


def test_emit_sbatch_refusal_of_a_local_launch_file_names_every_paper_file():
    """The message listed three of the five paper launch files and did not say why (issue 36's
    new-user pass: `nemo-run launch/stapo_tiny.py --emit-sbatch job.sh`)."""
    message = cli.emit_sbatch_refusal(fdl.build(executors.local_executor(nproc_per_node=2)), is_recipe=True)
    assert "this launch file runs a recipe on LocalExecutor (this machine: run it with --yes" in message
    assert message.endswith("The paper recipes' launch files: " + ", ".join(sorted(PAPER_FILES)))
    message = cli.emit_sbatch_refusal(run.SlurmExecutor(account="a"), is_recipe=False)
    assert "this launch file does not run a recipe (`entry.run_recipe`) on SlurmExecutor." in message


def test_a_run_dir_argument_points_at_output_dir(capsys):
    """NeMo-Run took ``run_dir=/x`` for one of its ``run.*`` options: "Run overwrites must start
    with 'run.'"."""
    assert cli.main([os.path.join(os.path.dirname(arguments.LAUNCH_DIR), "launch/stapo_tiny.py"), "run_dir=/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("nemo-run: unknown setting 'run_dir'; the run's folder is output_dir=/x. (Keys that start "
                          "with 'run' are NeMo-Run's own options: run.executor.FIELD=VALUE;"), err
    assert "overwrites must start" not in err


def test_settings_starting_with_run_are_named_with_the_closest_setting():
    from stapo_megatron.launch import entry

    settings = cli.launch_settings(entry.run_recipe)
    assert {"output_dir", "method", "config", "model", "steps", "seed"} <= set(settings) and "run_dir" not in settings
    assert arguments.run_key_problem(["--dryrun", "steps=3", "run.executor.nodes=2", "run.executor=local"],
                                     settings) is None
    assert arguments.run_key_problem(["runsteps=3"], settings).startswith(
        "unknown setting 'runsteps' (did you mean 'steps' or 'lr_warmup_steps'?). (Keys that start with 'run'")
    # a launch file without output_dir: no alias, no suggestion
    assert arguments.run_key_problem(["run_dir=/x"], ["nodes"]).startswith("unknown setting 'run_dir'. (Keys")


@pytest.mark.parametrize("override, message", [
    ("nodes=abc", "run.executor.nodes expects an integer, got 'abc'"),
    ("gpus_per_node=1.5", "run.executor.gpus_per_node expects an integer or None, got '1.5'"),
    ("container_mounts=abc", "run.executor.container_mounts expects a list such as ['a', 'b'], got 'abc'"),
    ("nodez=2", "unknown setting run.executor.nodez: SlurmExecutor has no 'nodez' (did you mean 'nodes'?)"),
    ("tunnel.job_dirr=/j", "unknown setting run.executor.tunnel.job_dirr: LocalTunnel has no 'job_dirr' (did you "
                           "mean 'job_dir'?)"),
])
def test_nemo_run_parse_errors_become_one_sentence(override, message):
    """NeMo-Run's own text repeated the value three times with its context dict."""
    from nemo_run.cli.cli_parser import CLIException, parse_cli_args

    config = executors.slurm_executor(nodes=2)
    with pytest.raises(CLIException) as raised, arguments.quiet_parser():
        parse_cli_args(config, [override])
    assert arguments.parse_error_message(raised.value, "run.executor.", config) == message


def test_a_parse_error_names_the_run_option_it_came_from():
    """With ``run.executor=NAME``, NeMo-Run parses the executor's fields and its own options together."""
    from nemo_run.cli.cli_parser import CLIException, parse_cli_args

    with pytest.raises(CLIException) as raised, arguments.quiet_parser():
        parse_cli_args(executors.slurm_executor(nodes=2), ["nodes=abc"])
    assert arguments.run_option_prefix(raised.value, ["executor=slurm", "executor.nodes=abc"]) == "run.executor."
    assert arguments.run_option_prefix(raised.value, ["nodes=abc"]) == "run."
    assert arguments.parse_error_message(raised.value, "run.") == "run.nodes expects an integer, got 'abc'"
    with pytest.raises(CLIException) as raised, arguments.quiet_parser():
        parse_cli_args(executors.slurm_executor(nodes=2), ["nodez=2"])
    assert arguments.parse_error_message(raised.value, "run.executor.") == "unknown setting run.executor.nodez"
