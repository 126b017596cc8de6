"""Tier a: the training-steps row needs two finite steps of a real run and names a crashed one."""

from stapo_megatron.doctor import steps


def test_steps_row_needs_two_finite_steps():
    row = dict(loss=0.0, rollout_train_logprob_diff=2e-7, **{p: 1.0 for p in steps.PHASES})
    ok = steps.row_from_run([dict(row, step=1), dict(row, step=2)], 0, 30.0, "")
    assert ok.status == "pass" and ok.values["time_train"] == 2.0
    assert steps.row_from_run([dict(row, step=1)], 0, 30.0, "").status == "fail"
    crashed = steps.row_from_run([], 1, 30.0, "ValueError: boom")
    assert crashed.status == "fail" and crashed.detail == "the run exited with 1: ValueError: boom"
    assert "warmstart.steps=0" in steps.command("/tmp/x") and "output_dir=/tmp/x" in steps.command("/tmp/x")
