"""Progress of a run for the trainer's per-step line: ETA and tokens/s of rollout and training.

Throughput counts the response tokens of a step over all DP ranks (they are generated and
trained on in parallel) divided by that phase's time: ``rollout_tokens_per_s`` over
``time_rollout`` (vLLM generation; with separate placement the engine's own ``time_engine_generate``,
as ``time_rollout`` is then the trainer's wait), ``train_tokens_per_s`` over ``time_train`` (the policy
update's forward and backward passes). The ETA is the mean time per step since this process
started its loop (evaluations and checkpoints included) times the steps left.
"""

from __future__ import annotations

import time
from typing import Callable, Dict


WALL_CLOCK_FIELDS = ("rollout_tokens_per_s", "train_tokens_per_s", "eta_s")
"""The fields `Progress.update` adds to a step's row; like the ``time_*`` fields they depend on the
machine's speed, not on the run's seed."""


def response_tokens(row: Dict, group_size: int) -> float:
    """Response tokens of a step's metrics row over all DP ranks."""
    return row["response_len_mean"] * row["num_prompts"] * group_size


def format_duration(seconds: float) -> str:
    """``1h02m03s`` / ``4m05s`` / ``6s``."""
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """Per finished step: tokens/s of the step's phases and the ETA of the run.

    Args:
        total_steps: the run's last step (`TrainerConfig.steps`).
        first_step: the step this process starts from (0, or a resumed checkpoint's).
        group_size: samples per prompt.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, total_steps: int, first_step: int, group_size: int,
                 clock: Callable[[], float] = time.monotonic):
        self.total_steps, self.first_step, self.group_size = total_steps, first_step, group_size
        self.clock = clock
        self.started = clock()

    def update(self, row: Dict) -> Dict[str, float]:
        """The progress fields of a finished step's row (``step`` = steps done): tokens/s and
        ``eta_s``, to be added to the row."""
        tokens = response_tokens(row, self.group_size)
        done = row["step"] - self.first_step
        per_step = (self.clock() - self.started) / max(done, 1)
        # separate placement: the engines generated while the trainers did other work
        generating = row.get("time_engine_generate", row["time_rollout"])
        return dict(
            rollout_tokens_per_s=tokens / generating if generating > 0 else 0.0,
            train_tokens_per_s=tokens / row["time_train"] if row["time_train"] > 0 else 0.0,
            eta_s=per_step * (self.total_steps - row["step"]),
        )


def describe(row: Dict, total_steps: int) -> str:
    """The progress part of the per-step line, from a row `Progress.update` has filled in."""
    percent = 100.0 * row["step"] / max(total_steps, 1)
    return (f"{row['step']}/{total_steps} ({percent:.0f}%) ETA {format_duration(row['eta_s'])} | "
            f"tok/s rollout {row['rollout_tokens_per_s']:.0f} train {row['train_tokens_per_s']:.0f}")
