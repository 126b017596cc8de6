"""Tier a: a resumed run's logs hold every step once (the killed run's rows after the checkpoint
are dropped before the resumed run logs those steps again)."""

import json
import warnings

import pytest

from stapo_megatron.runlog.metrics import RunLogger, truncate_jsonl
from stapo_megatron.runlog.plots import read_metrics


def _steps(path):
    with open(path) as f:
        return [(r.get("kind"), r["step"]) for r in map(json.loads, f)]


def test_resume_drops_rows_after_the_checkpoint_step(tmp_path):
    killed = RunLogger(str(tmp_path), tensorboard=False)
    killed.log({"kind": "eval", "step": 0, "eval_accuracy": 0.1})
    for step in range(1, 6):  # the killed run got to step 5; its last checkpoint is step 3
        killed.log({"kind": "train", "step": step, "loss": 1.0 / step})
        killed.log_silenced(step, [(7, -8.0, 0.1, 1.0)], str)
        if step == 2:
            killed.log({"kind": "eval", "step": 2, "eval_accuracy": 0.2})
        if step == 4:
            killed.log({"kind": "eval", "step": 4, "eval_accuracy": 0.4})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "st')  # a line cut off by the kill
    killed.close()

    resumed = RunLogger(str(tmp_path), tensorboard=False)
    with pytest.warns(UserWarning, match=r"metrics.jsonl: removed 4 rows logged after step 3"):
        resumed.resume_from(3)
    for step in (4, 5):
        resumed.log({"kind": "train", "step": step, "loss": 0.5})
        resumed.log_silenced(step, [(7, -8.0, 0.1, 1.0)], str)
    assert _steps(tmp_path / "metrics.jsonl") == [
        ("eval", 0), ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4), ("train", 5)]
    assert [s for _, s in _steps(tmp_path / "silenced_tokens.jsonl")] == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in read_metrics(str(tmp_path)) if r["kind"] == "train"] == [1.0, 0.5, 1 / 3, 0.5, 0.5]


def test_truncate_is_a_no_op_without_later_rows(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert truncate_jsonl(str(path), 3) == 0 and not path.exists()  # a fresh run dir
    path.write_text('{"step": 1}\n{"step": 2}\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert truncate_jsonl(str(path), 2) == 0
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    RunLogger(str(tmp_path / "other"), enabled=False).resume_from(0)  # non-zero ranks write nothing
    assert not (tmp_path / "other").exists()


def test_resume_cuts_the_rollout_order_log_back_to_the_steps_the_checkpoint_trained(tmp_path):
    """The order log names 0-based steps: a checkpoint after 2 steps keeps steps 0 and 1's lines."""
    path = tmp_path / "rollout_order.jsonl"
    killed = [{"step": s, "positions": {"0": [2 * s, 2 * s + 1]}} for s in range(4)]  # killed after step 3
    path.write_text("".join(json.dumps(line) + "\n" for line in killed) + '{"step": 4, "posi')
    with pytest.warns(UserWarning, match=r"rollout_order.jsonl: removed 3 rows logged after step 1"):
        RunLogger(str(tmp_path), tensorboard=False).resume_from(2)
    assert [json.loads(line) for line in open(path)] == killed[:2]
