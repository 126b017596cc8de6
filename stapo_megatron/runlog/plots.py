"""Curves of runs' ``metrics.jsonl``: a panel per metric vs step, a line per run.

`plot_runs` draws them (the trainer's ``metrics.png`` is one run's, redrawn at every eval);
``stapo-plot RUN... --out PNG`` (`main`) overlays several runs, e.g. two methods or seeds:

    stapo-plot runs/demo runs/demo-grpo --out curves.png
    stapo-plot runs/a runs/b --out curves.png --keys reward_mean,eval_accuracy,rollout_tokens_per_s
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Dict, List, Optional, Sequence

PLOTTED = ("reward_mean", "entropy_mean", "silenced_fraction", "tau_h", "eval_accuracy")
"""The metrics of a run's metrics.png panels."""


def read_metrics(run_dir: str) -> List[Dict]:
    """The rows of ``<run_dir>/metrics.jsonl``."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str, keys: Sequence[str] = PLOTTED) -> str:
    """``<run_dir>/metrics.png``: a panel per metric vs step (eval rows for eval_accuracy)."""
    return plot_runs([run_dir], os.path.join(run_dir, "metrics.png"), keys)

MARKED = ("eval_accuracy",)
"""Metrics drawn with point markers (eval rows: a few points, not a dense curve)."""


def _points(rows, key: str):
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))
            and not isinstance(r.get(key), bool)]


def _load(run_dirs: Sequence[str]) -> List[List[dict]]:
    """Each run's metrics rows; ValueError naming a folder without ``metrics.jsonl``."""
    missing = [d for d in run_dirs if not os.path.isfile(os.path.join(d, "metrics.jsonl"))]
    if missing:
        raise ValueError(f"no metrics.jsonl in {', '.join(missing)} (a run folder has one after its first step)")
    return [read_metrics(d) for d in run_dirs]


def check_keys(runs: List[List[dict]], keys: Sequence[str]) -> None:
    """ValueError for a key no run has a number for, naming the ones they have."""
    absent = [k for k in keys if not any(_points(rows, k) for rows in runs)]
    if absent:
        have = sorted({k for rows in runs for r in rows for k in r if _points([r], k)} - {"step"})
        raise ValueError(f"no run has values for {absent}; metrics available: {', '.join(have)}")


def plot_runs(run_dirs: Sequence[str], out: str, keys: Sequence[str] = PLOTTED,
              labels: Optional[Sequence[str]] = None) -> str:
    """One PNG at ``out`` with a panel per metric in ``keys`` (x: step) and a line per run.

    Args:
        run_dirs: run folders with a ``metrics.jsonl``.
        out: the PNG to write (its folder is created).
        keys: metrics of the rows to draw.
        labels: legend names (default: the folders' names); a legend only for several runs.
    Returns:
        ``out``.
    Raises:
        ValueError: a folder without ``metrics.jsonl``. (A metric no row has gives an empty
            panel: early in a run there is no eval yet.)
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = _load(run_dirs)
    labels = list(labels) if labels else [os.path.basename(os.path.abspath(d)) for d in run_dirs]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for rows, label in zip(runs, labels):
            points = _points(rows, key)
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if key in MARKED else None, markersize=3, label=label)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    """``stapo-plot RUN... --out PNG [--keys a,b] [--labels x,y]``."""
    p = argparse.ArgumentParser(prog="stapo-plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (each with a metrics.jsonl)")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--keys", default=",".join(PLOTTED), help=f"comma-separated metrics (default: {','.join(PLOTTED)})")
    p.add_argument("--labels", help="comma-separated legend names, one per run (default: folder names)")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.runs):
        p.error(f"--labels has {len(labels)} names for {len(args.runs)} runs")
    keys = [k for k in args.keys.split(",") if k]
    try:
        if args.keys != p.get_default("keys"):  # metrics asked for by name must exist
            check_keys(_load(args.runs), keys)
        out = plot_runs(args.runs, args.out, keys, labels)
    except ValueError as e:
        p.error(str(e))
    print(out)
