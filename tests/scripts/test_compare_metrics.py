"""Tier a: scripts/compare_metrics.py, the same-maths check of two runs' metrics.jsonl."""

import json
import math

from tests.helpers.repo_scripts import compare_metrics


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_wall_clock_fields_are_ignored_and_maths_is_not(tmp_path, capsys):
    row = dict(kind="train", step=1, loss=0.25, tau_h=math.nan, time_train=1.0, train_tokens_per_s=9.0, eta_s=3.0)
    before = _write(tmp_path / "a.jsonl", [row])
    slower = _write(tmp_path / "b.jsonl", [dict(row, time_train=2.0, train_tokens_per_s=4.5, eta_s=6.0)])
    assert compare_metrics.main([before, slower]) == 0
    assert "SAME: 1 rows, 4 values identical" in capsys.readouterr().out  # kind, step, loss, tau_h (NaN = NaN)
    changed = _write(tmp_path / "c.jsonl", [dict(row, loss=0.25000001), dict(row, step=2)])
    assert compare_metrics.main([before, changed]) == 1
    out = capsys.readouterr().out
    assert "row 0 (train step 1): loss 0.25 -> 0.25000001" in out and "1 rows before, 2 after" in out
    assert compare_metrics.differences([row], [{k: v for k, v in row.items() if k != "loss"}]) == [
        "row 0 (train step 1): loss only before"]


def test_a_tolerance_counts_close_floats_as_the_same_and_nothing_else():
    row = {"kind": "train", "step": 1, "loss": 0.125, "tokens": 40, "nan": float("nan")}
    close = {**row, "loss": 0.125 * (1 + 3e-6)}
    assert compare_metrics.differences([row], [close]) != []  # SAME means identical
    assert compare_metrics.differences([row], [close], rel_tol=1e-5) == []
    assert compare_metrics.differences([row], [{**row, "loss": 0.125 * (1 + 3e-5)}], rel_tol=1e-5) != []
    assert compare_metrics.differences([row], [{**row, "tokens": 41}], rel_tol=1e-5) != []  # counts exact
