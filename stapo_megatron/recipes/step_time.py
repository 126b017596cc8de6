"""The estimated time of one paper-recipe training step on H100s, and what it means for Slurm.

Not a measurement (nothing here has run on a GPU): the calibrated cost model the rollout-schedule
simulator runs on (`stapo_megatron.recipes.step_model`: vLLM decode and prefill at efficiencies
fitted to two published runs, the trainer's forward passes and update with the recipe's
recompute, the weight switch or transfer) over the paper's length distribution capped at the
recipe's ``rollout.max_response_len``, so that the launch defaults (time limit x requeues, the
save-before-the-limit signal) are derived from a stated number and a dry run can show it. A real
run's ``time_step`` metric replaces it (`stapo_megatron.runlog.progress`).

Step = rollout (the engines generating a step, to the slowest engine's longest response; with
colocated engines, their sleep, wake and weight reload) + training (the pi_old pass, the exact
tau_H pass, GRPO's reference, the update and its recomputation), or the longer of the two with
separate placement and ``rollout.separate.max_staleness`` >= 1 (each on its own GPUs, both paying the
weight transfer); streaming rollouts by `step_model.streaming_step`, within 10% of the
simulator's queue schedule.
"""

from __future__ import annotations

import dataclasses
import math

SAVE_S = 120.0
"""Allowance for one checkpoint save (the ~200 GB of a 14B checkpoint over 64 ranks)."""
JOB_STARTUP_S = 900.0
"""Allowance per Slurm job for container start, checkpoint load and vLLM start-up."""


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one training step (estimate)."""

    rollout_s: float
    """vLLM generation of ``prompts_per_step x group_size`` responses."""
    training_s: float
    """Log-prob passes and the policy update."""
    overlapped: bool = False
    """Separate placement with ``rollout.separate.max_staleness`` >= 1 (and streaming): the engines generate
    the next step while the trainers train this one, so a step takes the longer of the two."""

    @property
    def total_s(self) -> float:
        """One step."""
        return max(self.rollout_s, self.training_s) if self.overlapped else self.rollout_s + self.training_s


def estimate_step_time(spec, layout, cfg) -> StepTime:
    """The step time of ``cfg`` on ``layout`` (a `memory.ParallelLayout` after overrides) for ``spec``
    (`step_model.estimate`). Evaluation (every ``eval.every`` steps) is not included."""
    from stapo_megatron.recipes import step_model

    rollout_s, training_s, overlapped = step_model.estimate(step_model.recipe_job(spec, layout, cfg))
    return StepTime(rollout_s=rollout_s, training_s=training_s, overlapped=overlapped)


def signal_seconds(step: StepTime) -> int:
    """Seconds before the time limit at which to save and stop: one and a half steps plus a save,
    in whole minutes, at least 10 minutes."""
    return max(600, 60 * math.ceil((1.5 * step.total_s + SAVE_S) / 60))


def jobs_needed(steps: int, step: StepTime, time_limit_s: float, signal_s: float) -> int:
    """Slurm jobs of ``time_limit_s`` that a run of ``steps`` steps needs (each loses its start-up
    and the time after the save signal)."""
    useful = time_limit_s - signal_s - JOB_STARTUP_S
    if useful <= step.total_s:
        raise ValueError(f"a time limit of {time_limit_s / 3600:.1f} h leaves {useful / 60:.0f} min after start-up "
                         f"and the save signal: less than one step (~{step.total_s / 60:.1f} min)")
    return math.ceil(steps * step.total_s / useful)


def parse_slurm_time(text: str) -> float:
    """Seconds of an sbatch ``--time`` value: [D-]HH:MM:SS, HH:MM or MM."""
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 3:
        h, m, s = parts
    elif len(parts) == 2:
        (h, m), s = parts, 0
    else:
        h, m, s = 0, parts[0], 0
    return ((int(days) if days else 0) * 24 + h) * 3600 + m * 60 + s
