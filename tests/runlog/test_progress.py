"""Tier a: the trainer's progress fields (tokens/s, ETA) and line, with a clock the test drives."""

import pytest

from stapo_megatron.runlog.progress import Progress, describe, format_duration


def _row(step):
    # 8 prompts x G=4 samples x 25 tokens = 800 response tokens
    return dict(step=step, response_len_mean=25.0, num_prompts=8, time_rollout=4.0, time_train=2.0)


def test_tokens_per_second_and_eta_of_a_resumed_run():
    now = [100.0]
    progress = Progress(total_steps=20, first_step=10, group_size=4, clock=lambda: now[0])  # resumed at 10
    now[0] += 30.0  # steps 11 and 12 took 30 s together
    row = _row(12)
    row.update(progress.update(row))
    assert row["rollout_tokens_per_s"] == pytest.approx(800 / 4.0)
    assert row["train_tokens_per_s"] == pytest.approx(800 / 2.0)
    assert row["eta_s"] == pytest.approx(15.0 * 8)  # 15 s a step, 8 steps left
    assert describe(row, 20) == "12/20 (60%) ETA 2m00s | tok/s rollout 200 train 400"


def test_a_phase_too_short_to_time_reports_zero_not_an_error():
    progress = Progress(total_steps=1, first_step=0, group_size=1, clock=lambda: 0.0)
    fields = progress.update(dict(_row(1), time_rollout=0.0))
    assert fields["rollout_tokens_per_s"] == 0.0 and fields["eta_s"] == 0.0


@pytest.mark.parametrize("seconds, text", [(6.4, "6s"), (245, "4m05s"), (3723, "1h02m03s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
