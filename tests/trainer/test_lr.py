"""Tier a: the learning-rate warm-up counts training steps from lr 0 (veRL's schedule)."""

import pytest

from stapo_megatron.trainer.lr import warmup_lr


def test_warmup_counts_training_steps_from_zero():
    lrs = [warmup_lr(step, 1e-6, 10) for step in range(13)]
    assert lrs == pytest.approx([1e-6 * s / 10 for s in range(10)] + [1e-6] * 3, rel=1e-12, abs=0)
    assert lrs[0] == 0.0  # veRL's first step trains at lr 0
    assert [warmup_lr(step, 1e-3, 0) for step in range(3)] == [1e-3] * 3
