"""stapo-doctor (issue 34): its rows' logic (tier a) and its CPU subset end to end (slow): every
check that applies to a CPU machine passes with numbers inside its bounds, the GPU-only ones are
skipped with their reason, and the launch file renders a one- or two-node job."""

import json
import os
import subprocess
import sys

import pytest

from stapo_megatron.doctor import collectives, report, steps, versions
from tests.helpers import REPO_DIR

REPO = REPO_DIR


def test_a_raising_check_is_a_failed_row_and_the_report_counts_it():
    def broken():
        raise OSError("libcudart.so.13: cannot open shared object file")

    rows = [report.run_check("te", broken), report.passed("a", "fine"), report.skipped("b", "no GPU"),
            report.within("c", "mean |delta log p|", 0.03, 0.02)]
    assert rows[0].status == "fail" and rows[0].detail == "OSError: libcudart.so.13: cannot open shared object file"
    assert rows[3].status == "fail" and rows[3].detail == "mean |delta log p| 0.03 (bound 0.02)"
    assert report.exit_code(rows) == 1 and report.exit_code(rows[1:3]) == 0
    assert report.format_table(rows).splitlines()[-1] == "1 passed, 2 failed, 1 skipped"
    assert [c["status"] for c in json.loads(report.to_json(rows))["checks"]] == ["fail", "pass", "skip", "fail"]
    assert report.select(("x", "y", "z"), ["x", "z"], ["z"]) == ["x"]
    with pytest.raises(ValueError, match=r"unknown check 'vlm'; the checks are \['x', 'y'\]"):
        report.select(("x", "y"), None, ["vlm"])
    with pytest.raises(ValueError, match="Check.status must be one of"):
        report.Check("x", "ok")


def test_known_bad_version_combinations_are_named():
    good = dict(torch="2.14.0+cu130", vllm="0.33.0", triton="3.6.0", **{"megatron-core": "0.19.2"})
    assert versions.known_problems(good, "13.0", "13.0", "2.14.0", "3.6.0") == []
    # an NGC image whose constraint file kept its own torch under vLLM
    ngc = dict(good, torch="2.9.0a0+50eac811a6.nv25.10")
    assert versions.known_problems(ngc, "13.0", "13.0", "2.14.0", None) == [
        "vllm 0.33.0 pins torch==2.14.0 but torch 2.9.0a0+50eac811a6.nv25.10 is installed (on an NGC image: its "
        "/etc/pip/constraint.txt kept the image's torch)"]
    problems = versions.known_problems(dict(good, triton="3.5.1", **{"megatron-core": "0.20.0"}), "13.0", "12.8",
                                       "2.14.0", "3.6.0")
    assert problems == ["torch 2.14.0+cu130 pins triton==3.6.0 but triton 3.5.1 is installed",
                        "megatron-core 0.20.0 is outside the tested range 0.16 - 0.19",
                        "torch is built for CUDA 13.0 but the driver supports CUDA 12.8 at most (CUDA 13 needs an "
                        "R580 or newer driver)"]
    assert versions.known_problems(dict(good, **{"megatron-core": None}), None, None, None, None) == [
        "megatron-core is not installed"]


def test_collectives_row_holds_nvlink_to_its_nominal_figure():
    assert collectives.nominal_gbps("NVIDIA H100 80GB HBM3") == 450 and collectives.nominal_gbps("NVIDIA GB200") == 900
    assert collectives.nominal_gbps("NVIDIA L40S") is None
    fast = dict(ranks=8, all_reduce_busbw_gbps=380.0, all_gather_busbw_gbps=350.0)
    assert collectives.row(fast, "nccl", "NVIDIA H100 80GB HBM3").status == "pass"
    slow = collectives.row(dict(fast, all_gather_busbw_gbps=40.0), "nccl", "NVIDIA H100 80GB HBM3")
    assert slow.status == "fail" and "under 50% of NVIDIA H100 80GB HBM3's nominal 450 GB/s" in slow.detail
    # between nodes, or an unknown GPU: the numbers, no bound
    assert collectives.row(dict(slow.values, multi_node=True), "nccl", "NVIDIA H100 80GB HBM3").status == "pass"


def test_steps_row_needs_two_finite_steps():
    row = dict(loss=0.0, rollout_train_logprob_diff=2e-7, **{p: 1.0 for p in steps.PHASES})
    ok = steps.row_from_run([dict(row, step=1), dict(row, step=2)], 0, 30.0, "")
    assert ok.status == "pass" and ok.values["time_train"] == 2.0
    assert steps.row_from_run([dict(row, step=1)], 0, 30.0, "").status == "fail"
    crashed = steps.row_from_run([], 1, 30.0, "ValueError: boom")
    assert crashed.status == "fail" and crashed.detail == "the run exited with 1: ValueError: boom"
    assert "warmstart.steps=0" in steps.command("/tmp/x") and "output_dir=/tmp/x" in steps.command("/tmp/x")


def test_unknown_check_is_a_usage_error(capsys):
    from stapo_megatron.doctor.cli import main

    assert main(["--only", "nccl"]) == 2
    assert "unknown check 'nccl'" in capsys.readouterr().err




def test_engine_start_row_checks_every_paper_recipe_on_the_card():
    """On this CPU machine the row checks the 80 GiB card the memory model assumes; every paper
    recipe's engine starts there (the refusals themselves: tests/recipes/test_engine_memory.py)."""
    from stapo_megatron.doctor import engine

    row = engine.check_engine_start()
    assert (row.status, row.values["card_bytes"]) == (report.PASS, 80 * 2**30)
    assert "every paper recipe's engine starts on the model's 85.9 GB card" in row.detail
