"""The tiny MoE demo's results table: run it (unless finished) and write the table from its metrics.

    .venv/bin/python examples/demo_moe.py                 # = make demo-moe
    .venv/bin/python examples/demo_moe.py --out runs/demo-moe --no-run   # table from a finished run

Runs ``nemo-run launch/stapo_tiny_moe.py output_dir=OUT --yes`` (NeMo-Run, torchrun, 2
processes, expert parallelism 2 over gloo), then reads ``OUT/metrics.jsonl`` and puts into
docs/results.md between the ``demo-moe`` markers: per RL step the loss, the mean reward, the routing
disagreement between the rollout engine and training (mean / max over layers), training's
expert load (max / mean tokens per expert, per layer), the rollout's worst layer, and the aux
loss (sum over layers); the held-out accuracy after the warm-start and at the end; the machine,
date, commit and wall time.
"""

import argparse
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from demo_seeds import nemo_run  # noqa: E402  (examples/: the one way the demo scripts launch)


def run(run_dir):
    """The demo into ``run_dir``; returns its wall time in seconds."""
    return nemo_run(["launch/stapo_tiny_moe.py", f"output_dir={run_dir}"], "demo-moe")


def table(rows):
    """The per-step markdown table of the MoE columns."""
    train = [r for r in rows if r.get("kind") == "train"]
    if not train or not any(k.startswith("moe/") for k in train[0]):
        raise ValueError("the run's metrics.jsonl has no MoE training rows (moe/... keys)")
    layers = sorted({int(k.split("/")[1][5:]) for k in train[0] if k.startswith("moe/layer")})
    lines = ["| step | loss | reward | routing disagreement (mean / max) | expert load, training "
             f"(max / mean tokens, layers {layers[0]}-{layers[-1]}, 0-based) | rollout (worst layer) | aux loss (sum of layers) |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in train:
        routing = (f"{r['routing_disagreement_mean']:.3g} / {r['routing_disagreement_max']:.3g}"
                   if "routing_disagreement_mean" in r else "not measured")
        load = ", ".join(f"{r[f'moe/layer{i}/max_over_mean']:.2f}" for i in layers)
        rollout = f"{r['rollout_expert_load_max']:.2f}" if "rollout_expert_load_max" in r else "-"
        lines.append(f"| {r['step']} | {r['loss']:+.4f} | {r['reward_mean']:.3f} | {routing} | {load} | "
                     f"{rollout} | {r['moe/aux_loss']:.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo-moe")
    parser.add_argument("--no-run", action="store_true", help="only write the table from a finished run")
    parser.add_argument("--page", default=None, help="the markdown page with the block (default: docs/results.md)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from stapo_megatron.runlog.plots import read_metrics
    from stapo_megatron.runlog.report import RESULTS_PAGE, fill_block, runs_commit

    run_dir = os.path.join(ROOT, args.out)
    seconds = None if args.no_run else run(args.out)
    rows = read_metrics(run_dir)
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not evals:
        raise SystemExit(f"{run_dir}/metrics.jsonl has no evaluation rows: did the run finish?")
    when = time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(os.path.join(run_dir, "metrics.jsonl"))))
    timing = f", {seconds / 60:.1f} min wall time with the warm-start" if seconds is not None else ""
    text = (f"`make demo-moe` ({args.out}), {when}, commit {runs_commit([run_dir])}, {platform.machine()} "
            f"with {os.cpu_count()} cores{timing}. Held-out accuracy {evals[0]['eval_accuracy']:.3f} at RL step "
            f"{evals[0]['step']} (after the warm-start), {evals[-1]['eval_accuracy']:.3f} at step {evals[-1]['step']}.\n\n"
            + table(rows))
    fill_block(args.page or os.path.join(ROOT, RESULTS_PAGE), "demo-moe", text)
    print(text)


if __name__ == "__main__":
    main()
