"""Where the streaming recipe pays: the node split, the trainer's recomputation, the tau_H source
and the engines' memory share of `launch/stapo_8b_stream.py`'s recipe (``qwen3_8b_stream``), each
in the simulator's schedules as built (`sim_recipe.simulate`: ``queue`` and ``slices``) at each
eta and order, against the colocated `launch/stapo_8b.py` (``qwen3_8b``) in tokens/s/GPU, so a
recipe on more nodes is compared per GPU.

A candidate is (nodes, trainer GPUs, recomputation, ``loss.tau_h_source``, the engines'
``rollout.gpu_memory_utilization``): the engine GPUs are the rest, TP=1 engines (streaming steps
one engine per process). The trainer keeps the recipe's replicas (TP = 4, PP = CP = 1, so DP =
trainer GPUs / 4 must divide a mini-batch's 64 prompts) and must fit the memory model
(`stapo_megatron.recipes.memory.memory_estimate`, the dry run's check). Every candidate gets the
package's closed form (`step_model.streaming_step`, the dry run's estimate); those within
``--simulate-above`` of the best closed-form ratio are simulated at each eta, schedule and order.
Each simulated row prints its token-age distribution over the steady steps.

    PYTHONPATH=benchmarks .venv/bin/python benchmarks/sim_split.py [--etas 2,3] [--steps 12]
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from sim_model import sample_prompts
from sim_recipe import COLOCATED_RECIPE, SCHEDULES, STREAMING_RECIPE, colocated_job, job_of, recipe, shares, simulate
from sim_schedules import colocated, steady
from sim_streaming import ORDERS

from stapo_megatron.recipes import memory, step_model

RECOMPUTE = {"full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
             "none": dict(recompute_granularity=None, recompute_method=None, recompute_num_layers=None)}
"""The trainer's recomputation: full (single layers) or none (selective counts as none in both the
memory model and the cost model)."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    nodes: int
    trainer_gpus: int
    recompute: str
    tau_h_source: str
    memory_share: float
    reserve_tokens: int = 4096

    @property
    def engine_gpus(self) -> int:
        return self.nodes * 8 - self.trainer_gpus

    @property
    def name(self) -> str:
        return (f"{self.nodes} nodes: {self.trainer_gpus} train (DP={self.trainer_gpus // 4}, recompute "
                f"{self.recompute}, tau_H {self.tau_h_source}), {self.engine_gpus} engines at {self.memory_share}, "
                f"reserve {self.reserve_tokens}")


def candidate_jobs(c: Candidate):
    """(`step_model.RecipeJob`, simulator `Job`, memory estimate GB) of a candidate."""
    overrides = {"loss.tau_h_source": c.tau_h_source, "rollout.gpu_memory_utilization": c.memory_share,
                 "rollout.streaming.reserve_tokens": c.reserve_tokens,
                 **{f"model.{k}": v for k, v in RECOMPUTE[c.recompute].items()}}
    cfg, layout, spec = recipe(STREAMING_RECIPE, **overrides)
    layout = layout.replace(num_nodes=c.nodes, engine_ranks=c.engine_gpus)
    sj = step_model.recipe_job(spec, layout, cfg)
    return sj, job_of(sj), memory.memory_estimate(spec, layout).total / memory.GB


def candidates(nodes: Sequence[int], shares_: Sequence[float]) -> List[Candidate]:
    """Every split of ``nodes`` whose trainer is whole TP=4 replicas with DP dividing 64 and
    leaves at least one engine node, each recomputation, tau_H source and share."""
    out = []
    for n in nodes:
        for trainers in range(8, n * 8, 8):
            if 64 % (trainers // 4):
                continue
            for rc in RECOMPUTE:
                for tau in ("exact", "old"):
                    out += [Candidate(n, trainers, rc, tau, s) for s in shares_]
    return out


def closed_form(cands: List[Candidate], base_tps: float) -> List[Tuple[Candidate, float, float, float, float]]:
    """(candidate, rollout s, training s, memory GB, tokens/s/GPU ratio to ``base_tps``) of each
    candidate that fits 80 GB, by the dry run's closed form."""
    rows = []
    for c in cands:
        sj, job, gb = candidate_jobs(c)
        if gb >= memory.GPU_MEMORY_BYTES / memory.GB:
            continue
        rollout, training = step_model.streaming_step(sj)
        tokens = sj.prompts_per_step * sj.group * (sj.lengths.mean_prompt + sj.lengths.mean_response())
        rows.append((c, rollout, training, gb, tokens / max(rollout, training) / job.num_gpus / base_tps))
    return rows


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="4,5,6,7")
    p.add_argument("--shares", default="0.85,0.9")
    p.add_argument("--etas", default="2,3")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--orders", default=",".join(ORDERS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate-above", type=float, default=1.1,
                   help="simulate the candidates whose closed-form ratio reaches this")
    p.add_argument("--only", default=None,
                   help="simulate only these candidates: nodes/trainers/recompute/tau/share[/reserve];...")
    args = p.parse_args(argv)
    base = colocated_job()
    etas = [int(e) for e in args.etas.split(",")]
    prompts = sample_prompts(base.lengths, (args.steps + max(etas) + 1) * base.prompts_per_step, base.group, args.seed)
    batches = [prompts[s * base.prompts_per_step:(s + 1) * base.prompts_per_step] for s in range(args.steps)]
    b = steady(colocated(base, batches), base.num_gpus, args.warmup)
    base_tps = b["tokens_per_s_per_gpu"]
    closed_base = step_model.estimate(step_model.recipe_job(*_colocated_parts()))
    closed_tps = (base.prompts_per_step * base.group * (base.lengths.mean_prompt + base.lengths.mean_response())
                  / sum(closed_base[:2]) / base.num_gpus)
    print(f"colocated ({COLOCATED_RECIPE}), {base.num_gpus} GPUs: simulated {b['step_s']:.1f} s a step, "
          f"{base_tps:.0f} tokens/s/GPU; closed form {sum(closed_base[:2]):.1f} s")
    rows = closed_form(candidates([int(n) for n in args.nodes.split(",")],
                                  [float(s) for s in args.shares.split(",")]), closed_tps)
    rows.sort(key=lambda r: -r[4])
    print("\nclosed form (step_model.streaming_step, the dry run's), every candidate that fits 80 GB:\n")
    print("| candidate | GPUs | memory GB | rollout s | training s | vs colocated |\n" + "|" + " --- |" * 6)
    for c, rollout, training, gb, ratio in rows:
        print(f"| {c.name} | {c.nodes * 8} | {gb:.1f} | {rollout:.1f} | {training:.1f} | {ratio:.2f}x |")
    if args.only:
        picked = [Candidate(int(f[0]), int(f[1]), f[2], f[3], float(f[4]), *(int(r) for r in f[5:]))
                  for f in (x.split("/") for x in args.only.split(";"))]
    else:
        picked = [r[0] for r in rows if r[4] >= args.simulate_above]
    print(f"\nsimulated ({args.steps} steps, steady over the last {args.steps - args.warmup}; vs the simulated "
          f"colocated {base_tps:.0f} tokens/s/GPU):\n")
    print("| candidate | eta | schedule | order | step s | dry run's s | tokens/s/GPU | vs colocated | trainer idle "
          "| engine idle | preempted | tokens by age |\n" + "|" + " --- |" * 12, flush=True)
    for c in picked:
        sj, job, _ = candidate_jobs(c)
        closed = max(step_model.streaming_step(sj))
        for eta in etas:
            for schedule in args.schedules.split(","):
                for order in args.orders.split(","):
                    r = simulate(sj, job, prompts, args.steps, eta, schedule, order)
                    s = steady(r, job.num_gpus, args.warmup)
                    print(f"| {c.name} | {eta} | {schedule} | {order} | {s['step_s']:.1f} | {closed:.1f} | "
                          f"{s['tokens_per_s_per_gpu']:.0f} | {s['tokens_per_s_per_gpu'] / base_tps:.2f}x | "
                          f"{s['trainer_idle']:.0%} | {s['engine_idle']:.1%} | {r.get('preemptions', '-')} | "
                          f"{shares(r, 'step_token_age', args.warmup)} |", flush=True)


def _colocated_parts():
    cfg, layout, spec = recipe(COLOCATED_RECIPE)
    return spec, layout, cfg


if __name__ == "__main__":
    main()
