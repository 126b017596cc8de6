"""The tiny Qwen3.5 demo's results block: run it (unless finished) and write the block from its metrics.

    .venv/bin/python examples/demo_qwen35.py                 # = make demo-qwen35
    .venv/bin/python examples/demo_qwen35.py --out runs/demo-qwen35 --no-run   # block from a finished run

Runs ``nemo-run launch/stapo_tiny_qwen35.py output_dir=OUT --yes`` (NeMo-Run, torchrun, 2
processes, DP=2 over gloo, HF-engine rollouts), then reads ``OUT/metrics.jsonl`` and puts into
docs/results.md between the ``demo-qwen35`` markers: the held-out accuracy after the warm-start
and at each evaluation, per RL step the loss, the mean reward, the entropy, the silenced tokens,
the rollout/training log-prob mismatch, training tokens/s and the step's time; the machine (cores,
load average at the start and the end of the run), date, commit and wall time.
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
    return nemo_run(["launch/stapo_tiny_qwen35.py", f"output_dir={run_dir}"], "demo-qwen35")


def table(rows):
    """The per-step markdown table."""
    train = [r for r in rows if r.get("kind") == "train"]
    if not train:
        raise ValueError("the run's metrics.jsonl has no training rows")
    lines = ["| step | loss | reward | entropy | silenced tokens | engine/trainer max abs. dlogp | train tok/s | step time (s) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in train:
        seconds = sum(v for k, v in r.items() if k.startswith("time_"))
        lines.append(f"| {r['step']} | {r['loss']:+.4f} | {r['reward_mean']:.3f} | {r['entropy_mean']:.3f} | "
                     f"{r['silenced_count']} | {r['mismatch_abs_logprob_diff_max']:.1e} | "
                     f"{r['train_tokens_per_s']:.0f} | {seconds:.1f} |")
    return "\n".join(lines)


def summary(rows) -> str:
    """The held-out accuracy at each evaluation, the first after the warm-start."""
    evals = [r for r in rows if r.get("kind") == "eval"]
    if not evals:
        raise ValueError("the run's metrics.jsonl has no evaluation rows: did the run finish?")
    points = ", ".join(f"{r['eval_accuracy']:.3f} at step {r['step']}" for r in evals)
    gain = evals[-1]["eval_accuracy"] - evals[0]["eval_accuracy"]
    return f"Held-out accuracy (avg@4 at T = 1, 100 problems): {points} (step 0: after the warm-start; {gain:+.3f})."


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo-qwen35")
    parser.add_argument("--no-run", action="store_true", help="only write the block from a finished run")
    parser.add_argument("--page", default=None, help="the markdown page with the block (default: docs/results.md)")
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    from stapo_megatron.runlog.plots import read_metrics
    from stapo_megatron.runlog.report import RESULTS_PAGE, fill_block, runs_commit

    run_dir = os.path.join(ROOT, args.out)
    load_start = os.getloadavg()[0]
    seconds = None if args.no_run else run(args.out)
    rows = read_metrics(run_dir)
    when = time.strftime("%Y-%m-%d", time.gmtime(os.path.getmtime(os.path.join(run_dir, "metrics.jsonl"))))
    timing = (f", {seconds / 60:.1f} min wall time with the warm-start (1-minute load average {load_start:.1f} "
              f"at the start, {os.getloadavg()[0]:.1f} at the end)" if seconds is not None else "")
    text = (f"`make demo-qwen35` ({args.out}), {when}, commit {runs_commit([run_dir])}, {platform.machine()} "
            f"with {os.cpu_count()} cores{timing}. {summary(rows)}\n\n" + table(rows))
    fill_block(args.page or os.path.join(ROOT, RESULTS_PAGE), "demo-qwen35", text)
    print(text)


if __name__ == "__main__":
    main()
