"""The streaming recipe as built, in the simulator: `launch/stapo_8b_stream.py`'s recipe
(``qwen3_8b_stream``) against the colocated `launch/stapo_8b.py` (``qwen3_8b``), both read from
the package's recipes, over the same prompts.

Everything the simulator takes from a recipe comes from the package
(`stapo_megatron.recipes.step_model.recipe_job`, the model the dry run's estimate reads): the
model's shapes, the engine GPUs and their TP and memory share, the trainer GPUs and replicas, the
trainer's passes (the streaming recipe's: the pi_old pass, tau_H from it, and the update without
recomputation on a card of its own; the colocated recipe's: pi_old and the exact tau_H pass, its
activations kept under CP=2),
the KV reservation a sample (prompt + ``rollout.streaming.reserve_tokens``) and the response cap.
The schedules (`sim_streaming.streaming`): ``slices``, as built (each replica's prompts in fixed
slices over its 12 engines, a stream, quota and eta count per slice, a step waiting for every
slice), and ``queue`` (a replica's groups admitted by whichever of its engines has room, eta
counted per group), each in completion and admission order at each eta. Each row prints the
token-age distribution of the steady steps (trained step minus the policy version that sampled
the token, per token) and the package's closed-form step (`step_model.streaming_step`, what the
dry run prints) beside the simulated one.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/sim_recipe.py [--etas 2,3] [--steps 12] [--tau-h-source exact]
"""

from __future__ import annotations

import argparse
import collections
from typing import Dict, List, Optional, Sequence, Tuple

from sim_model import sample_prompts
from sim_schedules import Job, colocated, steady
from sim_streaming import ORDERS, streaming

from stapo_megatron.config.overrides import apply_overrides
from stapo_megatron.recipes import paper, step_model

STREAMING_RECIPE, COLOCATED_RECIPE = "qwen3_8b_stream", "qwen3_8b"
SCHEDULES = ("slices", "queue")
"""The built schedule and the one being built (`sim_streaming`)."""


def recipe(name: str, **overrides):
    """(config, layout, architecture) of a paper recipe (``overrides``: dotted config fields)."""
    cfg = apply_overrides(paper.paper_recipe(name), overrides)
    return cfg, paper.layout_for(name, cfg), paper.ARCHITECTURES[name]


def streaming_jobs(name: str = STREAMING_RECIPE, engine_gpus: Optional[int] = None,
                   **overrides) -> Tuple[step_model.RecipeJob, Job]:
    """The package's `RecipeJob` of a streaming recipe (``engine_gpus``: another split of its
    GPUs) and the simulator's `Job` of it."""
    cfg, layout, spec = recipe(name, **overrides)
    if engine_gpus is not None:
        layout = layout.replace(engine_ranks=engine_gpus)
    sj = step_model.recipe_job(spec, layout, cfg)
    return sj, job_of(sj)


def job_of(sj: step_model.RecipeJob) -> Job:
    """The simulator's `Job` of a streaming `RecipeJob`."""
    return Job(sj.model, sj.hardware, num_gpus=sj.engine_gpus + sj.trainer_gpus, engine_tp=sj.engine_tp,
               prompts_per_step=sj.prompts_per_step, group=sj.group, lengths=sj.lengths,
               separate_memory_share=sj.memory_share, recompute=sj.recompute,
               trainer_replica_gpus=sj.trainer_replica_gpus, forwards=sj.forwards, eff=sj.eff)


def colocated_job(name: str = COLOCATED_RECIPE) -> Job:
    """The simulator's `Job` of a colocated recipe (its trainer's passes as the package counts them)."""
    cfg, layout, spec = recipe(name)
    return Job(step_model.model_spec(spec), step_model.H100, num_gpus=layout.world_size,
               engine_tp=layout.vllm_tensor_parallel_size, prompts_per_step=cfg.prompts_per_step,
               group=cfg.rollout.group_size, lengths=step_model.recipe_lengths(cfg),
               colocated_memory_share=layout.vllm_gpu_memory_utilization,
               recompute=cfg.model.recompute_granularity == "full", forwards=step_model.recipe_forwards(cfg))


def dry_run_s(name: str) -> float:
    """The step the dry run prints for a recipe (`stapo_megatron.recipes.step_time`)."""
    from stapo_megatron.recipes import step_time

    cfg, layout, spec = recipe(name)
    return step_time.estimate_step_time(spec, layout, cfg).total_s


def simulate(sj: step_model.RecipeJob, job: Job, prompts, steps: int, eta: int, schedule: str,
             order: str) -> Dict:
    """One streaming run of the recipe's job at its split and reservation."""
    return streaming(job, prompts, steps, sj.engine_gpus, eta, order=order, engine_tp=sj.engine_tp,
                     kv_reserve=sj.kv_reserve, schedule=schedule)


def compare(steps: int, warmup: int, etas: Sequence[int], schedules: Sequence[str] = SCHEDULES, seed: int = 0,
            engine_gpus: Optional[int] = None, **overrides) -> List[Tuple[str, Dict, Dict, float]]:
    """Rows (name, run, steady figures, the package's closed-form step s): the colocated recipe,
    then the streaming recipe at each eta, schedule and order, over the same prompts."""
    sj, job = streaming_jobs(engine_gpus=engine_gpus, **overrides)
    base = colocated_job()
    prompts = sample_prompts(job.lengths, (steps + max(etas) + 1) * job.prompts_per_step, job.group, seed)
    batches = [prompts[s * job.prompts_per_step:(s + 1) * job.prompts_per_step] for s in range(steps)]
    r = colocated(base, batches)
    rows = [(f"colocated ({COLOCATED_RECIPE}), {base.num_gpus} GPUs, vLLM TP={base.engine_tp}", r,
             steady(r, base.num_gpus, warmup), dry_run_s(COLOCATED_RECIPE))]
    closed = max(step_model.streaming_step(sj))  # the dry run's, for the recipe's split
    for eta in etas:
        for schedule in schedules:
            for order in ORDERS:
                r = simulate(sj, job, prompts, steps, eta, schedule, order)
                rows.append((f"{STREAMING_RECIPE}, eta = {eta}, {schedule}, {order} order", r,
                             steady(r, job.num_gpus, warmup), closed))
    return rows


def shares(run: Dict, key: str, warmup: int) -> str:
    """The steady steps' counts of ``run[key]`` (a Counter a step) as shares by age."""
    if key not in run:
        return "-"
    counts = sum(run[key][warmup:], collections.Counter())
    total = sum(counts.values())
    return ", ".join(f"{age}: {n / total:.1%}" for age, n in sorted(counts.items()) if n / total >= 0.0005) or "-"


def table(rows: List[Tuple[str, Dict, Dict, float]], warmup: int) -> str:
    base = rows[0][2]["tokens_per_s_per_gpu"]
    lines = ["| run | step s | dry run's estimate s | tokens/s/GPU | vs colocated | trainer idle | engine idle "
             "| preempted | groups by staleness | tokens by age |", "|" + " --- |" * 10]
    for name, r, s, closed in rows:
        lines.append(f"| {name} | {s['step_s']:.1f} | {closed:.1f} | "
                     f"{s['tokens_per_s_per_gpu']:.0f} | {s['tokens_per_s_per_gpu'] / base:.2f}x | "
                     f"{s['trainer_idle']:.0%} | {s['engine_idle']:.1%} | {r.get('preemptions', '-')} | "
                     f"{shares(r, 'step_staleness', warmup)} | {shares(r, 'step_token_age', warmup)} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the steady-state figures")
    p.add_argument("--etas", default="2,3")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="slices, queue, shared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-gpus", type=int, default=None, help="another split of the recipe's 32 GPUs")
    p.add_argument("--tau-h-source", choices=("old", "exact"), default=None,
                   help="the streaming trainer's loss.tau_h_source (exact: a second forward pass; "
                        "default: the recipe's)")
    args = p.parse_args(argv)
    overrides = {"loss.tau_h_source": args.tau_h_source} if args.tau_h_source else {}
    sj, job = streaming_jobs(engine_gpus=args.engine_gpus, **overrides)
    rollout_s, training_s = step_model.streaming_step(sj)
    print(f"{sj.model.name} ({STREAMING_RECIPE}): {sj.engine_gpus} engine GPUs of TP={sj.engine_tp} at "
          f"{sj.memory_share}, {sj.trainer_gpus} trainer GPUs in replicas of {sj.trainer_replica_gpus}, "
          f"{sj.prompts_per_step} prompts x {sj.group} a step, trainer: {sj.forwards} forward pass(es) and the update"
          f"{' with full recompute' if sj.recompute else ''}, KV reserve prompt + {sj.reserve_tokens} "
          f"(kv_reserve {sj.kv_reserve:.3f}); {args.steps} steps, steady state over the last "
          f"{args.steps - args.warmup}; closed form (step_model.streaming_step, the dry run's): rollout "
          f"{rollout_s:.1f} s, training {training_s:.1f} s")
    rows = compare(args.steps, args.warmup, [int(e) for e in args.etas.split(",")], args.schedules.split(","),
                   args.seed, args.engine_gpus, **overrides)
    print(table(rows, args.warmup))


if __name__ == "__main__":
    main()
