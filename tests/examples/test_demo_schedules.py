"""examples/demo_schedules.py: the schedules table of docs/results.md and the README's streaming line
come from the runs' numbers (summaries as `benchmarks/async_cpu.py` makes them)."""

import importlib.util
import os

from tests.helpers import REPO_DIR


def _module():
    spec = importlib.util.spec_from_file_location("demo_schedules", os.path.join(REPO_DIR, "examples",
                                                                                 "demo_schedules.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summary(first, last, silenced, wait, idle, minutes=6.0):
    return dict(first=first, last=last, silenced=silenced, wait=wait, idle=idle, minutes=minutes)


def test_every_mode_runs_its_make_targets_launch_file():
    ds = _module()
    assert list(ds.MODES) == ["colocated", "separate", "streaming"]
    for args in ds.MODES.values():
        assert os.path.exists(os.path.join(REPO_DIR, args[0]))
    assert "rollout.mode=streaming" in ds.MODES["streaming"]


def test_table_and_readme_line_carry_each_runs_numbers():
    ds = _module()
    results = [("colocated", _summary(0.5, 0.74, 530, 0.33, 0.67), 0),
               ("streaming", _summary(0.5, 0.745, 545, 0.02, 0.01), 3)]
    rows = ds.table(results).splitlines()
    assert rows[2] == "| colocated | 0.500 | 0.740 | 530 | 33% | 67% | 0 | 6.0 min |"
    assert rows[3] == "| streaming | 0.500 | 0.745 | 545 | 2% | 1% | 3 | 6.0 min |"
    line = ds.readme_line(results, "Measured 2026-01-01 on x86_64 at commit abc1234")
    assert line.startswith("Streaming demo: held-out 0.500 -> 0.745, 545 tokens silenced, against 0.500 -> 0.740 "
                           "and 530 colocated on the same seed.")
    assert "at commit abc1234 by `make demo-schedules`" in line


def test_oldest_token_reads_the_token_age_or_the_staleness(tmp_path):
    import json

    ds = _module()
    rows = [{"kind": "train", "step": 0, "staleness": 0.0}, {"kind": "train", "step": 1, "token_age_max": 3.0},
            {"kind": "eval", "step": 1, "eval_accuracy": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ds.oldest_token(str(tmp_path)) == 3
