"""Tier a: stapo-doctor's rows: a raising check is a failed row, bounds, the table (with the device
line), JSON and exit code, and the choice of checks."""

import json

import pytest

from stapo_megatron.doctor import report


def test_a_raising_check_is_a_failed_row_and_the_report_counts_it():
    def broken():
        raise OSError("libcudart.so.13: cannot open shared object file")

    rows = [report.run_check("te", broken), report.passed("a", "fine"), report.skipped("b", "no GPU"),
            report.within("c", "mean |delta log p|", 0.03, 0.02)]
    assert rows[0].status == "fail" and rows[0].detail == "OSError: libcudart.so.13: cannot open shared object file"
    assert rows[3].status == "fail" and rows[3].detail == "mean |delta log p| 0.03 (bound 0.02)"
    assert report.exit_code(rows) == 1 and report.exit_code(rows[1:3]) == 0
    assert report.format_table(rows).splitlines()[-1] == "1 passed, 2 failed, 1 skipped"
    assert report.format_table(rows).splitlines()[0].startswith("check ")
    table = report.format_table(rows, "NVIDIA H200").splitlines()
    assert table[0] == "device: NVIDIA H200" and table[1].startswith("check ") and len(table) == 7
    assert json.loads(report.to_json(rows, dict(device="cpu")))["device"] == "cpu"
    assert [c["status"] for c in json.loads(report.to_json(rows))["checks"]] == ["fail", "pass", "skip", "fail"]
    assert report.select(("x", "y", "z"), ["x", "z"], ["z"]) == ["x"]
    with pytest.raises(ValueError, match=r"unknown check 'vlm'; the checks are \['x', 'y'\]"):
        report.select(("x", "y"), None, ["vlm"])
    with pytest.raises(ValueError, match="Check.status must be one of"):
        report.Check("x", "ok")
