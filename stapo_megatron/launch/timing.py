"""Time on Slurm, from the FINAL configuration: the save signal, the requeue budget, and the
step-time and memory lines a dry run prints.

A launch file builds its executor before the command line is read (`executors.paper_slurm_executor`
derives the signal and budget from the un-overridden recipe); `apply_final` derives them again
from the configuration the job will run (overrides, ``config=run.yaml``) and the executor's
nodes and time limit, unless the user set them (``STAPO_SLURM_SIGNAL_S`` / ``run.executor.signal``,
``STAPO_SLURM_RETRIES`` / ``run.executor.retries``). `report` prints the estimate and returns the
problems a submission would have with it. The estimate itself is `stapo_megatron.recipes.step_time`.
"""

import dataclasses
import os
from typing import Collection, List, Optional, Tuple

from stapo_megatron.trainer.preemption import torchrun_env

FAILURE_RETRIES = 5
"""Requeues a paper run may spend on failures on top of those its time limit needs (both share
Slurm's one ``retries`` budget; `stapo_megatron.launch.requeue` requeues a failure only after a
new checkpoint)."""

MANY_JOBS = 50
"""Above this many jobs a dry run suggests a longer time limit (each job loses its start-up and
the save margin)."""

LONGER_TIME = "24:00:00"
"""The time limit the hint offers (many partitions allow a day)."""


def _step(recipe: str, cfg, nodes: int, gpus_per_node: int):
    from stapo_megatron.recipes import step_time
    from stapo_megatron.recipes.lora import recipe_module

    recipes = recipe_module(recipe)
    layout = dataclasses.replace(recipes.layout_for(recipe, cfg), num_nodes=nodes, gpus_per_node=gpus_per_node)
    return layout, step_time.estimate_step_time(recipes.ARCHITECTURES[recipe], layout, cfg)


def derived_timing(recipe: str, cfg, nodes: int, gpus_per_node: int, time_limit: str,
                   signal_s: Optional[int] = None) -> Tuple[int, int]:
    """(save signal seconds, requeue budget) of ``cfg`` on ``nodes`` x ``gpus_per_node`` GPUs at
    ``time_limit``: 1.5 estimated steps + a save (unless ``signal_s`` is given); the jobs the steps
    need - 1 + the failure allowance (``STAPO_SLURM_FAILURE_RETRIES``, default `FAILURE_RETRIES`).
    ValueError when a job of ``time_limit`` cannot hold one step."""
    from stapo_megatron.recipes import step_time

    _, step = _step(recipe, cfg, nodes, gpus_per_node)
    signal_s = signal_s or step_time.signal_seconds(step)
    jobs = step_time.jobs_needed(cfg.steps, step, step_time.parse_slurm_time(time_limit), signal_s)
    failures = int(os.environ.get("STAPO_SLURM_FAILURE_RETRIES") or FAILURE_RETRIES)
    return signal_s, jobs - 1 + failures


def signal_of(executor) -> int:
    """The seconds of the executor's ``--signal=USR1@S``."""
    return int(str(executor.signal or "USR1@0").rpartition("@")[2])


def apply_final(executor, recipe: str, cfg, given: Collection[str]) -> None:
    """Set ``executor``'s save signal (with torchrun's grace period) and ``retries`` from ``cfg``,
    except those in ``given`` ("signal", "retries") or in their STAPO_* variables. A time limit too
    short for one step leaves them as they are (`report` says so)."""
    keep_signal = "signal" in given or bool(os.environ.get("STAPO_SLURM_SIGNAL_S"))
    keep_retries = "retries" in given or bool(os.environ.get("STAPO_SLURM_RETRIES"))
    if keep_signal and keep_retries:
        return
    try:
        signal_s, retries = derived_timing(recipe, cfg, executor.nodes, executor.gpus_per_node, executor.time,
                                           signal_of(executor) if keep_signal else None)
    except ValueError:
        return
    if not keep_signal:
        executor.signal = f"USR1@{signal_s}"
        executor.env_vars = {**executor.env_vars, **torchrun_env(signal_s)}
    if not keep_retries:
        executor.retries = retries


def report(cfg, recipe: str, executor) -> List[str]:
    """Print the estimated layout, memory and step time of ``cfg`` on ``executor`` and what they
    mean at its time limit; the problems a submission would have (a save signal shorter than a
    step, too few requeues)."""
    from stapo_megatron.recipes import memory, step_time
    from stapo_megatron.recipes.lora import recipe_module

    layout, step = _step(recipe, cfg, executor.nodes, executor.gpus_per_node)
    signal_s = signal_of(executor)
    limit_s = step_time.parse_slurm_time(executor.time)
    r = cfg.rollout
    s = r.streaming
    rollouts = ("" if r.mode == "colocated" else
                f"# rollouts: streaming, eta (rollout.separate.max_staleness) {r.separate.max_staleness}, {s.order} "
                f"order, weights loaded {s.weight_load.replace('_', '-')}, KV reserved a sample: prompt + "
                f"{s.reserve_tokens or r.max_response_len} tokens; correction {cfg.loss.rollout_correction.mode}\n"
                if r.mode == "streaming" else f"# rollouts: {r.mode}, k (rollout.separate.max_staleness) "
                f"{r.separate.max_staleness}; correction {cfg.loss.rollout_correction.mode}\n")
    print(f"# ---- layout and memory per GPU (recipes/memory.py: an estimate) ----\n"
          f"# {memory.describe(recipe_module(recipe).ARCHITECTURES[recipe], layout)}\n{rollouts}"
          f"# ---- time (an estimate, recipes/step_model.py, the simulator's calibrated model: not measured) ----\n"
          f"# one step ~{step.total_s / 60:.1f} min (rollout {step.rollout_s / 60:.1f}, training "
          f"{step.training_s / 60:.1f}); {cfg.steps} steps ~{cfg.steps * step.total_s / 3600:.0f} h of "
          f"{layout.world_size} GPUs", flush=True)
    if signal_s < step.total_s + step_time.SAVE_S:
        return [f"the save signal {signal_s} s before the time limit is shorter than one step plus a save "
                f"(~{step.total_s + step_time.SAVE_S:.0f} s): raise STAPO_SLURM_SIGNAL_S or "
                "run.executor.signal=USR1@SECONDS"]
    try:
        jobs = step_time.jobs_needed(cfg.steps, step, limit_s, signal_s)
    except ValueError as e:
        return [str(e)]
    print(f"# time limit {executor.time}, save signal {signal_s} s before it: ~{jobs} jobs; "
          f"retries={executor.retries} (requeues for the time limit, and for failures after a new checkpoint)",
          flush=True)
    if jobs > MANY_JOBS and limit_s < step_time.parse_slurm_time(LONGER_TIME):
        longer = step_time.jobs_needed(cfg.steps, step, step_time.parse_slurm_time(LONGER_TIME), signal_s)
        lost = (signal_s + step_time.JOB_STARTUP_S) / 60
        print(f"# hint: ~{jobs} jobs of {executor.time}, each losing ~{lost:.0f} min to start-up and the save "
              f"margin; if the partition allows, STAPO_SLURM_TIME={LONGER_TIME} (or run.executor.time=...) "
              f"needs ~{longer}", flush=True)
    if executor.retries < jobs - 1:
        return [f"retries={executor.retries} cannot finish {cfg.steps} steps: at ~{step.total_s / 60:.1f} "
                f"min a step they need ~{jobs} jobs of {executor.time}; set STAPO_SLURM_RETRIES or "
                f"run.executor.retries to at least {jobs - 1} (plus some for failures)"]
    return []
