"""Colocated vs separate placement on the CPU demo: where each side waits.

    .venv/bin/python benchmarks/async_cpu.py runs/demo runs/demo-sep0 runs/demo-async

Reads each run's ``metrics.jsonl`` (make demo; make demo-async ARGS="rollout.separate.max_staleness=0
loss.rollout_correction.mode='none' output_dir=runs/demo-sep0"; make demo-async) and prints one row per run, medians over the
training steps after the first:

* trainer wait: the share of a step (its phases: rollout, reward, pi_old, update, sync) the
  trainers spend waiting for samples (``time_rollout``; colocated: generating them);
* engine idle: the share of its time the engine has no request or weights to work on
  (separate: ``time_engine_idle`` over generate + idle + load; colocated: every phase but the
  rollout, when the engine sleeps);
* the mean staleness, the mean token age (partial and streaming rollouts: the trained tokens'
  mean of step - version), the tokens S2T silenced over the run, the median tau_H (the entropy
  quantile), held-out accuracy at the first and last evaluation, the run's steps, and its wall
  minutes (from ``config.yaml``'s write to ``metrics.jsonl``'s last).

On a 2-core machine both pools share the cores, so the step times say little; the fractions say
where the schedule puts the waiting. Every process also competes with the others for the CPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

PHASES = ("time_rollout", "time_reward", "time_old_logprob", "time_train", "time_weight_sync", "time_routing")


def summarize(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    every = [r for r in rows if r["kind"] == "train"]
    train = every[1:]
    evals = [r for r in rows if r["kind"] == "eval"]
    step = [sum(r.get(k, 0.0) for k in PHASES) for r in train]
    wait = [r["time_rollout"] / s for r, s in zip(train, step)]
    if "time_engine_generate" in train[0]:
        idle = [r["time_engine_idle"] / max(1e-9, r["time_engine_generate"] + r["time_engine_idle"] + r["time_engine_load"])
                for r in train]
    else:
        idle = [1 - w for w in wait]
    return dict(run=run_dir, steps=len(train) + 1, wait=statistics.median(wait), idle=statistics.median(idle),
                step_s=statistics.median(step), staleness=statistics.mean(r.get("staleness", 0.0) for r in train),
                first=evals[0]["eval_accuracy"], last=evals[-1]["eval_accuracy"],
                age=statistics.mean(r.get("token_age_mean", r.get("staleness", 0.0)) for r in train),
                silenced=int(sum(r.get("silenced_count", 0) for r in every)),
                tau_h=statistics.median(r["tau_h"] for r in every if r.get("tau_h") == r.get("tau_h") and "tau_h" in r),
                minutes=(os.path.getmtime(os.path.join(run_dir, "metrics.jsonl"))
                         - os.path.getmtime(os.path.join(run_dir, "config.yaml"))) / 60)


def main(runs) -> None:
    print("| run | steps | trainer wait | engine idle | step (s, median) | staleness | token age | silenced | "
          "tau_H (median) | held-out first -> last | wall (min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        s = summarize(run)
        print(f"| {s['run']} | {s['steps']} | {s['wait']:.0%} | {s['idle']:.0%} | {s['step_s']:.2f} | "
              f"{s['staleness']:.2f} | {s['age']:.2f} | {s['silenced']} | {s['tau_h']:.3f} | "
              f"{s['first']:.3f} -> {s['last']:.3f} | {s['minutes']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:] or ["runs/demo", "runs/demo-sep0", "runs/demo-async"])
