"""What the calibrated rollout-schedule model predicts for a paper-scale job: colocated
synchronous against separate placement (k = 0, k = 1) and partial rollouts, steady state.

This is a model, not a measurement. Its cost model (`sim_model.py`) and schedules
(`sim_schedules.py`) were fitted (`sim_calibrate.py`) to NeMo-RL's published Llama-3.1-8B GRPO
run on 16 H100s (colocated and one step off) and to verl fully-async's Qwen2.5-Math-7B colocated
phase tables on H20s (generation, pi_old and update at 32 GPUs, generation at 64 and 128), and
checked against measurements the fit did not see: verl's pi_old and update at 64 and 128 GPUs
(within 10%), and, in a second fit without it, NeMo-RL's one-step-off figure (predicted 18% low).
RESULTS.md keeps the residuals. Nothing here was tuned to the paper-scale goal.

The jobs are two paper recipes on 32 H100s (4 nodes of 8), 256 prompts x 8 samples a step, over
the paper's lengths (prompts uniform in [100, 1024], responses log-normal with median 3000 and
sigma 0.9 capped at 15360), vLLM at 0.4 of the card colocated and 0.85 alone:

- `qwen3_8b`: Qwen3-8B, vLLM TP=4 colocated, trainer replicas of TP=4 x CP=2 without recompute.
- `qwen3_30b_a3b`: Qwen3-30B-A3B (MoE, 3.35B of its 30.5B parameters active a token), vLLM TP=4
  colocated, trainer TP=4 with EP=16 (ETP=1) and full recompute. Separate, the trainers need 16
  or 24 GPUs (the recipe's memory model: 46 GB a GPU at EP=16 on 16, 49 GB at EP=8 on 24; 80 GB
  on 8), and a trainer DP of 6 does not divide 2,048 samples: 16 engine GPUs. The training MFU
  curve is the dense models' fit: an MoE's all-to-all and grouped matmuls are not in it.

The separate schedules
try every engine TP in ``--engine-tps`` and every engine/trainer split the node layout allows
(`sim_schedules.splits`) and keep the fastest; every figure is steady state (the steps after
``--warmup``), the pipeline fill apart.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/sim_async.py [--recipe qwen3_8b|qwen3_30b_a3b]
"""

from __future__ import annotations

import argparse
import collections
from typing import Dict, List, Optional, Sequence, Tuple

from sim_model import H100, PAPER_LENGTHS, QWEN3_8B, QWEN3_30B_A3B, sample_prompts
from sim_schedules import Job, colocated, partial, separate, splits, steady
from sim_streaming import ORDERS, streaming

QWEN3_8B_JOB = Job(QWEN3_8B, H100, num_gpus=32, engine_tp=4, prompts_per_step=256, group=8, lengths=PAPER_LENGTHS,
                   colocated_memory_share=0.4, separate_memory_share=0.85, recompute=False, trainer_replica_gpus=8)
QWEN3_30B_A3B_JOB = Job(QWEN3_30B_A3B, H100, num_gpus=32, engine_tp=4, prompts_per_step=256, group=8,
                        lengths=PAPER_LENGTHS, colocated_memory_share=0.4, separate_memory_share=0.85, recompute=True,
                        trainer_replica_gpus=4, trainer_gpu_counts=(16, 24))
JOBS = {"qwen3_8b": QWEN3_8B_JOB, "qwen3_30b_a3b": QWEN3_30B_A3B_JOB}
"""The paper recipes the script models, by recipe name."""


def best(job: Job, run, engine_tps: Sequence[int], warmup: int) -> Tuple[Tuple[int, int], Dict, Dict]:
    """The (engine TP, engine GPUs) of the allowed splits that gives ``run`` the most steady
    tokens/s/GPU, with the run and its steady figures."""
    results = {}
    for tp, gpus in splits(job, tuple(engine_tps)):
        r = run(tp, gpus)
        results[(tp, gpus)] = (r, steady(r, job.num_gpus, warmup))
    if not results:
        raise ValueError(f"no engine/trainer split of {job.num_gpus} GPUs fits engine TPs {tuple(engine_tps)}")
    split = max(results, key=lambda s: results[s][1]["tokens_per_s_per_gpu"])
    return (split, *results[split])


def compare(job: Job, steps: int, warmup: int, oversample: float, engine_tps: Sequence[int],
            seed: int = 0) -> List[Tuple[str, str, Dict, Dict]]:
    """Rows (schedule, layout, run, steady figures) over the same prompts."""
    prompts = sample_prompts(job.lengths, int((steps + 2 + oversample) * job.prompts_per_step), job.group, seed)
    batches = [prompts[s * job.prompts_per_step:(s + 1) * job.prompts_per_step] for s in range(steps)]
    r = colocated(job, batches)
    rows = [("colocated, synchronous", f"{job.num_gpus} GPUs, TP={job.engine_tp}", r, steady(r, job.num_gpus, warmup))]
    for k in (0, 1):
        (tp, gpus), r, s = best(job, lambda tp, g: separate(job, batches, g, k, engine_tp=tp), engine_tps, warmup)
        rows.append((f"separate, k = {k}", f"{gpus} engine GPUs, TP={tp}", r, s))
    (tp, gpus), r, s = best(job, lambda tp, g: partial(job, prompts, steps, g, oversample, engine_tp=tp),
                            engine_tps, warmup)
    rows.append((f"separate, partial rollouts, oversample {oversample}", f"{gpus} engine GPUs, TP={tp}", r, s))
    return rows


UPDATES = {"in-flight": dict(in_flight=True), "in-flight, KV recomputed": dict(in_flight=True, recompute_kv=True),
           "drain": dict(in_flight=False)}
"""How the streaming engines take new weights (`sim_streaming.streaming`)."""


def compare_streaming(job: Job, steps: int, warmup: int, etas: Sequence[int], engine_tps: Sequence[int],
                      seed: int = 0, schedule: str = "shared") -> List[Tuple[str, str, Dict, Dict]]:
    """Rows (schedule, layout, run, steady figures): colocated, then streaming at each eta, way
    of loading weights and order, each at its best split, over the same prompts (``schedule``:
    `sim_streaming.SCHEDULES`; the recipe as built: `sim_recipe.py`)."""
    prompts = sample_prompts(job.lengths, (steps + max(etas) + 1) * job.prompts_per_step, job.group, seed)
    batches = [prompts[s * job.prompts_per_step:(s + 1) * job.prompts_per_step] for s in range(steps)]
    r = colocated(job, batches)
    rows = [("colocated, synchronous", f"{job.num_gpus} GPUs, TP={job.engine_tp}", r, steady(r, job.num_gpus, warmup))]
    for eta in etas:
        for updates, options in UPDATES.items():
            for order in ORDERS:
                (tp, gpus), r, s = best(job, lambda tp, g: streaming(job, prompts, steps, g, eta, order=order,
                                                                     engine_tp=tp, schedule=schedule, **options),
                                        engine_tps, warmup)
                rows.append((f"streaming, eta = {eta}, {updates}, {order} order", f"{gpus} engine GPUs, TP={tp}", r, s))
    return rows


def _shares(run: Dict, key: str, warmup: int) -> str:
    """The steady steps' counts of ``run[key]`` (a Counter a step) as shares by age."""
    if key not in run:
        return "-"
    counts = sum(run[key][warmup:], collections.Counter())
    total = sum(counts.values())
    return ", ".join(f"{age}: {n / total:.0%}" for age, n in sorted(counts.items()) if n / total >= 0.005) or "-"


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the steady-state figures")
    p.add_argument("--oversample", type=float, default=0.5)
    p.add_argument("--engine-tps", default="1,2,4", help="vLLM TPs the separate schedules may use")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recipe", choices=sorted(JOBS), action="append",
                   help="the recipe to model (repeatable; default: both)")
    p.add_argument("--streaming", action="store_true", help="streaming rollouts at each --etas against colocated")
    p.add_argument("--etas", default="1,2,3", help="off-policyness bounds of the streaming table")
    p.add_argument("--schedule", default="shared", help="the streaming schedule: shared, queue or slices")
    args = p.parse_args(argv)
    for recipe in args.recipe or list(JOBS):
        if args.streaming:
            streaming_table(JOBS[recipe], args)
        else:
            table(JOBS[recipe], args)


def streaming_table(job: Job, args: argparse.Namespace) -> None:
    """Print the markdown table of one job's streaming rows against colocated."""
    rows = compare_streaming(job, args.steps, args.warmup, [int(e) for e in args.etas.split(",")],
                             [int(t) for t in args.engine_tps.split(",")], args.seed, args.schedule)
    print(f"{job.model.name} on {job.num_gpus} {job.hardware.name}, {job.prompts_per_step} prompts x {job.group} a "
          f"step, {args.steps} steps, steady state over the last {args.steps - args.warmup}")
    base = rows[0][3]["tokens_per_s_per_gpu"]
    print("| schedule | layout | step s | tokens/s/GPU | vs colocated | fill s | trainer idle | engine idle "
          "| preempted | groups by staleness | tokens by age |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, layout, r, s in rows:
        print(f"| {name} | {layout} | {s['step_s']:.1f} | {s['tokens_per_s_per_gpu']:.0f} | "
              f"{s['tokens_per_s_per_gpu'] / base:.2f}x | {s['fill_s']:.0f} | {s['trainer_idle']:.0%} | "
              f"{s['engine_idle']:.0%} | {r.get('preemptions', '-')} | {_shares(r, 'step_staleness', args.warmup)} | "
              f"{_shares(r, 'step_token_age', args.warmup)} |", flush=True)


def table(job: Job, args: argparse.Namespace) -> None:
    """Print the markdown table of one job's schedules."""
    rows = compare(job, args.steps, args.warmup, args.oversample, [int(t) for t in args.engine_tps.split(",")],
                   args.seed)
    phases = rows[0][2]["phases"]
    print(f"{job.model.name} on {job.num_gpus} {job.hardware.name}, {job.prompts_per_step} prompts x {job.group} a "
          f"step, {args.steps} steps, steady state over the last {args.steps - args.warmup}; colocated step phases: "
          + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()))
    base = rows[0][3]["tokens_per_s_per_gpu"]
    print("| schedule | layout | step s | tokens/s/GPU | vs colocated | fill s | with fill | trainer idle "
          "| engine idle | KV peak | preempted | recomputed tokens | staleness |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, layout, r, s in rows:
        stale = ", ".join(f"{d}: {n}" for d, n in sorted(r.get("staleness", {}).items())) or "-"
        print(f"| {name} | {layout} | {s['step_s']:.1f} | {s['tokens_per_s_per_gpu']:.0f} | "
              f"{s['tokens_per_s_per_gpu'] / base:.2f}x | {s['fill_s']:.0f} | "
              f"{s['with_fill'] / rows[0][3]['with_fill']:.2f}x | {s['trainer_idle']:.0%} | {s['engine_idle']:.0%} "
              f"| {r['kv_peak']:.2f} | {r['preemptions']} | {r['recomputed_tokens'] / 1e6:.1f}M | {stale} |")


if __name__ == "__main__":
    main()
