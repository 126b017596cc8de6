"""The RL learning-rate schedule: linear warm-up, then constant (the paper's JustRL recipe)."""


def warmup_lr(step: int, peak_lr: float, warmup_steps: int) -> float:
    """Learning rate of training step ``step`` (0-based): linear warm-up from 0 over
    ``warmup_steps`` training steps, then constant, ``peak_lr * min(1, step / warmup_steps)``.

    As veRL's constant-with-warm-up schedule (stepped once per training step, so the first step
    trains at lr 0); all PPO mini-batches (optimizer steps) of one training step share it.
    ``warmup_steps = 0``: the peak from the first step.
    """
    if warmup_steps <= 0:
        return peak_lr
    return peak_lr * min(1.0, step / warmup_steps)
