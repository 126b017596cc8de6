"""examples/demo_qwen35.py: docs/results.md's demo-qwen35 block comes from the run's metrics rows."""

import importlib.util
import os

import pytest

from tests.helpers import REPO_DIR


def _demo_qwen35():
    spec = importlib.util.spec_from_file_location("demo_qwen35", os.path.join(REPO_DIR, "examples", "demo_qwen35.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train(step, reward):
    return dict(kind="train", step=step, loss=-0.01, reward_mean=reward, entropy_mean=0.5, silenced_count=3,
                mismatch_abs_logprob_diff_max=2e-5, train_tokens_per_s=812.4, time_rollout=2.0, time_train=3.5)


def test_block_from_the_rows():
    demo = _demo_qwen35()
    rows = [dict(kind="eval", step=0, eval_accuracy=0.4), _train(1, 0.375), _train(2, 0.5),
            dict(kind="eval", step=2, eval_accuracy=0.55)]
    assert demo.summary(rows).endswith("0.400 at step 0, 0.550 at step 2 (step 0: after the warm-start; +0.150).")
    lines = demo.table(rows).splitlines()
    assert len(lines) == 4 and all(line.count("|") == 9 for line in lines)  # 8 columns: no "|" inside a cell
    assert lines[2] == "| 1 | -0.0100 | 0.375 | 0.500 | 3 | 2.0e-05 | 812 | 5.5 |"


def test_a_run_without_rows_is_refused():
    demo = _demo_qwen35()
    with pytest.raises(ValueError, match="no evaluation rows"):
        demo.summary([_train(1, 0.5)])
    with pytest.raises(ValueError, match="no training rows"):
        demo.table([dict(kind="eval", step=0, eval_accuracy=0.4)])
