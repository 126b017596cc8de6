"""Tier a: the save signal and requeue budget of a Slurm job follow the final configuration's
step time (unless given), and a run of hundreds of jobs prints a longer time limit."""

import re

import pytest

pytest.importorskip("nemo_run")

import fiddle as fdl  # noqa: E402

from stapo_megatron.launch import executors, timing  # noqa: E402
from stapo_megatron.recipes import paper, step_time  # noqa: E402
from tests.helpers.launch_cli import config  # noqa: E402


def slurm(size):
    return fdl.build(executors.paper_slurm_executor(size))


def test_signal_and_retries_follow_the_final_configuration(monkeypatch):
    """The launch file's defaults are the un-overridden recipe's; `apply_final` replaces them."""
    for name in ("STAPO_SLURM_SIGNAL_S", "STAPO_SLURM_RETRIES", "STAPO_SLURM_FAILURE_RETRIES", "STAPO_SLURM_TIME"):
        monkeypatch.delenv(name, raising=False)
    executor = slurm("qwen3_8b")
    cfg = config("qwen3_8b", steps=10, prompts_per_step=512, rollout={"max_response_len": 31744},
                 model={"context_parallel_size": 4})  # a step of ~10 min: longer than the recipe's signal
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
