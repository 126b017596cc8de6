"""examples/demo_seeds.py: the per-seed table of docs/results.md, its goal line and the README's summary come
from the runs' numbers."""

import importlib.util
import os
from tests.helpers import REPO_DIR

ROOT = REPO_DIR


def _demo_seeds():
    spec = importlib.util.spec_from_file_location("demo_seeds", os.path.join(ROOT, "examples", "demo_seeds.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _result(seed, start, end, seconds, warmstart="trained", silenced=100):
    return dict(seed=seed, start=start, end=end, gain=end - start, silenced=silenced, steps_with_silenced=40,
                curve=[(0, start), (50, end)], seconds=seconds, warmstart=warmstart, load=[1.0, 2.0])


def test_goal_counts_only_seeds_meeting_every_part():
    ds = _demo_seeds()
    results = [
        _result(1, 0.50, 0.75, 6 * 60),                        # meets all
        _result(2, 0.38, 0.70, 6 * 60),                        # starts below 0.40
        _result(3, 0.50, 0.69, 6 * 60),                        # gains +0.19
        _result(4, 0.50, 0.75, 13 * 60),                       # over 12 minutes
        _result(5, 0.50, 0.75, 3 * 60, warmstart="loaded"),    # did not train its warm-start
    ]
    line = ds.goal_summary(results)
    assert "met by 1 of 5 seeds (1)." in line
    assert "Starts 0.380-0.500" in line and "3.0-13.0 min per run" in line


def test_table_has_a_row_per_seed_and_the_mean():
    ds = _demo_seeds()
    text = ds.table([_result(1, 0.5, 0.75, 360), _result(2, 0.4, 0.7, 0, silenced=50)], "avg@4 at T=1")
    rows = text.splitlines()
    assert rows[2].startswith("| 1 | 0.500 | 0.750 | +0.250 | 100 (40) | 6.0 min | trained |")
    assert "not recorded" in rows[3]
    assert rows[4] == "| mean | 0.450 | 0.725 | +0.275 | 75.0 | | | |"


def test_readme_summary_gives_the_means_and_where_they_were_measured():
    ds = _demo_seeds()
    stamp = "Measured 2026-01-01 on x86_64, 2 cores, Python 3.11.7 at commit abc1234"
    text = ds.readme_summary([_result(1, 0.4, 0.7, 240, silenced=500), _result(2, 0.5, 0.8, 300, silenced=400)],
                             "avg@4 at T=1", stamp)
    first, second = text.splitlines()
    assert first == ("Expected: held-out avg@4 at T=1 from 0.45 after the warm-start to 0.75 after RL (mean of 2 "
                     "seeds), 450 tokens silenced by S2T per run; 4.0-5.0 min per run on that machine.")
    assert second.startswith(stamp + " by `make demo-seeds`") and "(docs/results.md)" in second
