"""The embedded default over several seeds: the demo table and curve of docs/results.md and the
README's expected result come from here.

    .venv/bin/python examples/demo_seeds.py                      # = make demo-seeds: 5 seeds
    .venv/bin/python examples/demo_seeds.py --seeds 1234 1 --out runs/demo-seeds --figures docs/figures
    .venv/bin/python examples/demo_seeds.py --shared-warmstart   # train the warm-start once

Each seed runs exactly what ``make demo`` runs (``nemo-run launch/stapo_tiny.py seed=S
output_dir=OUT/seed_S --yes``: NeMo-Run, torchrun, 2 processes), one after another; a seed whose
run finished (its last evaluation logged) is not run again. By default every seed trains its own
warm-start, as ``make demo`` on a fresh clone does (``warmstart.cache_dir=OUT/seed_S/.warmstart-cache``),
so each row's wall time is a fresh clone's and equal starts show the warm-start does not depend
on the seed; ``--shared-warmstart`` trains it once (the first seed) and the others load it
from ``OUT/.warmstart-cache`` (the same weights, faster). Then it writes, from the runs'
``metrics.jsonl``:

    FIGURES/demo_seeds.png   held-out accuracy per evaluation step, one line per seed
    FIGURES/demo_seeds.md    per seed: accuracy at RL step 0 (after the warm-start) and at the
                             end, the gain, tokens S2T silenced, wall time; machine, date, commit,
                             and which seeds meet the demo's goal (`GOAL`)

and puts the table into docs/results.md between the ``demo-seeds`` markers and a short summary
(`readme_summary`) into README.md between the ``demo-summary`` markers.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

DEFAULT_SEEDS = (1234, 1, 2, 3, 4)
GOAL = dict(start=0.40, gain=0.20, minutes=12.0)
"""What every seed of the demo should show: held-out accuracy at least ``start`` after
the warm-start, at least ``gain`` higher at the end, the whole run (warm-start trained) within
``minutes`` on a 2-core machine."""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _finished(run_dir, steps):
    return any(r.get("kind") == "eval" and r["step"] == steps for r in _rows(run_dir))


def nemo_run(args, label: str) -> float:
    """``nemo-run ARGS --yes`` in the checkout (the venv's nemo-run, as a make target runs it),
    announced as ``label``; its wall time in seconds. The demo scripts' one way to launch a run."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "nemo-run"), *args, "--yes"]
    print(f"[{label}] {' '.join(cmd)}", flush=True)
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True)
    return time.time() - start


def run_seed(seed, run_dir, steps, shared_warmstart=False):
    """``make demo`` with this seed and output folder; returns what ``demo_run.json`` keeps: the
    wall time, whether the warm-start was trained (as on a fresh clone) or loaded from the shared
    cache, and the load average before and after (the machine's other work)."""
    from stapo_megatron.recipes.tiny import warmstart_cache_dir

    args = ["launch/stapo_tiny.py", f"seed={seed}", f"output_dir={run_dir}"]
    if shared_warmstart:
        cache = warmstart_cache_dir(os.path.join(ROOT, run_dir))
    else:
        cache = os.path.join(ROOT, run_dir, ".warmstart-cache")
        args.append(f"warmstart.cache_dir={cache}")
    cached = os.path.isdir(cache) and any(not n.startswith(".") for n in os.listdir(cache))
    load_before = os.getloadavg()[1]
    seconds = nemo_run(args, f"demo-seeds seed {seed}")
    if not _finished(os.path.join(ROOT, run_dir), steps):
        raise RuntimeError(f"seed {seed}: {run_dir}/metrics.jsonl has no evaluation at step {steps}")
    info = dict(seconds=seconds, warmstart="loaded" if cached else "trained",
                load=[round(load_before, 1), round(os.getloadavg()[1], 1)])
    with open(os.path.join(ROOT, run_dir, "demo_run.json"), "w") as f:  # kept for later summaries
        json.dump(info, f)
    return info


def _recorded(run_dir):
    path = os.path.join(run_dir, "demo_run.json")
    return json.load(open(path)) if os.path.exists(path) else dict(seconds=0.0, warmstart="?", load=None)


def summarise(seed, run_dir, info):
    rows = _rows(run_dir)
    evals = {r["step"]: r["eval_accuracy"] for r in rows if r.get("kind") == "eval"}
    train = [r for r in rows if r.get("kind") == "train"]
    first, last = min(evals), max(evals)
    return dict(seed=seed, start=evals[first], end=evals[last], gain=evals[last] - evals[first],
                silenced=sum(r["silenced_count"] for r in train),
                steps_with_silenced=sum(r["silenced_count"] > 0 for r in train),
                curve=sorted(evals.items()), **info)


def table(results, eval_desc):
    lines = [
        f"| seed | held-out {eval_desc}, RL step 0 | at the end | gain | tokens silenced by S2T "
        "(steps with any) | wall time | warm-start | load average (5 min) before / after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        wall = f"{r['seconds'] / 60:.1f} min" if r["seconds"] else "not recorded"
        load = " / ".join(str(x) for x in r["load"]) if r["load"] else "not recorded"
        lines.append(f"| {r['seed']} | {r['start']:.3f} | {r['end']:.3f} | {r['gain']:+.3f} | "
                     f"{r['silenced']} ({r['steps_with_silenced']}) | {wall} | {r['warmstart']} | {load} |")
    gains = [r["gain"] for r in results]
    lines.append(f"| mean | {sum(r['start'] for r in results) / len(results):.3f} | "
                 f"{sum(r['end'] for r in results) / len(results):.3f} | {sum(gains) / len(gains):+.3f} | "
                 f"{sum(r['silenced'] for r in results) / len(results):.1f} | | | |")
    return "\n".join(lines)


def goal_summary(results):
    """Which seeds meet `GOAL`, as a sentence for under the table."""
    def meets(r):
        return (r["start"] >= GOAL["start"] and r["gain"] >= GOAL["gain"] and r["warmstart"] == "trained"
                and 0 < r["seconds"] <= 60 * GOAL["minutes"])

    met = [str(r["seed"]) for r in results if meets(r)]
    lo = lambda key: min(r[key] for r in results)  # noqa: E731
    hi = lambda key: max(r[key] for r in results)  # noqa: E731
    timed = [r["seconds"] / 60 for r in results if r["seconds"]]
    return (f"Starts {lo('start'):.3f}-{hi('start'):.3f}, gains {lo('gain'):+.3f} to {hi('gain'):+.3f}, "
            f"{lo('silenced')}-{hi('silenced')} tokens silenced per run"
            + (f", {min(timed):.1f}-{max(timed):.1f} min per run" if timed else "")
            + f". Goal (start >= {GOAL['start']:.2f}, gain >= +{GOAL['gain']:.2f}, the whole run with "
            f"its own warm-start within {GOAL['minutes']:g} min): met by {len(met)} of {len(results)} seeds"
            + (f" ({', '.join(met)})" if met else "") + ".")


def readme_summary(results, eval_desc, stamp):
    """The README's expected result of ``make demo``: the mean over seeds in two lines, with where
    and when it was measured (``stamp``) and a pointer to the per-seed table."""
    n = len(results)
    timed = [r["seconds"] / 60 for r in results if r["seconds"]]
    minutes = f"; {min(timed):.1f}-{max(timed):.1f} min per run on that machine" if timed else ""
    return (f"Expected: held-out {eval_desc} from {sum(r['start'] for r in results) / n:.2f} after the "
            f"warm-start to {sum(r['end'] for r in results) / n:.2f} after RL (mean of {n} seeds), "
            f"{sum(r['silenced'] for r in results) / n:.0f} tokens silenced by S2T per run{minutes}.\n"
            f"{stamp} by `make demo-seeds`; per seed: [docs/results.md](docs/results.md).")


def plot(results, path, eval_desc):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for r in results:
        steps, acc = zip(*r["curve"])
        ax.plot(steps, acc, marker="o", markersize=3, label=f"seed {r['seed']}")
    ax.set_xlabel("RL step")
    ax.set_ylabel(f"held-out {eval_desc}")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("make demo (tiny Qwen3, STAPO, 2 CPU processes), per seed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    from stapo_megatron.recipes.tiny import tiny_demo
    from stapo_megatron.runlog.report import RESULTS_PAGE, fill_block, machine, runs_commit

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    parser.add_argument("--out", default="runs/demo-seeds")
    parser.add_argument("--figures", default="docs/figures")
    parser.add_argument("--no-publish", action="store_true",
                        help="do not update docs/results.md and README.md")
    parser.add_argument("--shared-warmstart", action="store_true",
                        help="train the warm-start once (first seed) and load it for the others")
    args = parser.parse_args()
    cfg, _ = tiny_demo()
    eval_desc = ("greedy accuracy" if cfg.eval.temperature == 0
                 else f"avg@{cfg.eval.samples} at T={cfg.eval.temperature:g}")
    results = []
    for seed in args.seeds:
        run_dir = os.path.join(args.out, f"seed_{seed}")
        done = _finished(os.path.join(ROOT, run_dir), cfg.steps)
        info = (_recorded(os.path.join(ROOT, run_dir)) if done
                else run_seed(seed, run_dir, cfg.steps, args.shared_warmstart))
        results.append(summarise(seed, os.path.join(ROOT, run_dir), info))
        print(f"[demo-seeds] seed {seed}: {results[-1]['start']:.3f} -> {results[-1]['end']:.3f}", flush=True)
    figures = os.path.join(ROOT, args.figures)
    os.makedirs(figures, exist_ok=True)
    plot(results, os.path.join(figures, "demo_seeds.png"), eval_desc)
    commit = runs_commit(os.path.join(ROOT, args.out, f"seed_{seed}") for seed in args.seeds)
    stamp = f"Measured {datetime.date.today().isoformat()} on {machine()} at commit {commit}"
    text = (f"{stamp} by `examples/demo_seeds.py` (`make demo` per seed, {cfg.steps} RL steps):\n\n"
            f"{table(results, eval_desc)}\n\n{goal_summary(results)}\n")
    with open(os.path.join(figures, "demo_seeds.md"), "w") as f:
        f.write(text)
    print(text)
    if not args.no_publish:
        fill_block(os.path.join(ROOT, RESULTS_PAGE), "demo-seeds", text)
        fill_block(os.path.join(ROOT, "README.md"), "demo-summary", readme_summary(results, eval_desc, stamp))


if __name__ == "__main__":
    main()
