"""Tier a: the step-time estimate of a paper recipe, its checkpoint retention and a 3000-step run's
time in jobs."""

import pytest

from stapo_megatron.recipes import paper


def test_retention_and_time_fit_a_3000_step_run():
    """keep_last bounds the disk (14B: ~200 GB a checkpoint); the save signal exceeds a step plus a
    save; the requeue budget covers the estimated run at the 4 h default limit."""
    from stapo_megatron.recipes import step_time

    for size in paper.LAYOUTS:
        cfg = paper.paper_recipe(size)
        assert (cfg.save_every, cfg.keep_last) == (10, 3)
        step = step_time.estimate_step_time(paper.ARCHITECTURES[size], paper.LAYOUTS[size], cfg)
        assert 60 < step.rollout_s < 3600 and 10 < step.training_s < 3600
        signal_s = step_time.signal_seconds(step)
        assert signal_s >= step.total_s + step_time.SAVE_S and signal_s % 60 == 0
        jobs = step_time.jobs_needed(cfg.steps, step, 4 * 3600, signal_s)
        useful = 4 * 3600 - signal_s - step_time.JOB_STARTUP_S
        assert (jobs - 1) * useful < cfg.steps * step.total_s <= jobs * useful
    assert step_time.parse_slurm_time("1-02:03:04") == 93784
    assert step_time.parse_slurm_time("04:00:00") == 14400 and step_time.parse_slurm_time("90") == 5400
    with pytest.raises(ValueError, match="less than one step"):
        step_time.jobs_needed(3000, step, 1600, 600)  # 100 s after start-up and the signal
