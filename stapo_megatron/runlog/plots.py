"""Curves of runs' ``metrics.jsonl``: a panel per metric vs step, a line per run.

`plot_runs` draws them (the trainer's ``metrics.png`` is one run's, redrawn at every eval);
``stapo-plot RUN... --out PNG`` (`main`) overlays several runs, e.g. two methods or seeds:

    stapo-plot runs/demo runs/demo-grpo --out curves.png
    stapo-plot runs/a runs/b --out curves.png --keys reward_mean,eval_accuracy,rollout_tokens_per_s

``stapo-plot RUN --grad-norm STEP --out PNG`` (`plot_grad_norm`) draws the paper's figure for one
training step instead: the logit-gradient norm of a token's loss term against its probability and
its entropy (``stapo_megatron.ops.logit_grad``). The step row's (log10 p) x H grid gives the RMS
norm of every trained token in a cell (a heatmap, and its two marginals as lines); the step's
silenced tokens are drawn one by one from ``silenced_tokens.jsonl`` (norms before silencing).
"""

from __future__ import annotations

import argparse
import json
import math
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


def _grid_axes():
    from stapo_megatron.ops.logit_grad import GRID_ENTROPY, GRID_LOG10_P

    edges = lambda axis: [axis[0] + (axis[1] - axis[0]) * i / axis[2] for i in range(axis[2] + 1)]  # noqa: E731
    return edges(GRID_LOG10_P), edges(GRID_ENTROPY)


def _step_rows(run_dir: str, step) -> tuple:
    """The train row of ``step`` ("last": the last one) that has the gradient grid, and that
    step's silenced tokens (``per_token`` records; [] without silenced_tokens.jsonl)."""
    rows = [r for r in _load([run_dir])[0] if r.get("kind") == "train" and r.get("grad_norm_grid_count")]
    if not rows:
        raise ValueError(f"{run_dir}: no train row with grad_norm_grid_count (runs before the gradient metrics)")
    picked = rows[-1] if step == "last" else next((r for r in rows if r["step"] == int(step)), None)
    if picked is None:
        raise ValueError(f"{run_dir}: no train step {step}; steps with the grid: {rows[0]['step']}..{rows[-1]['step']}")
    path = os.path.join(run_dir, "silenced_tokens.jsonl")
    tokens = []
    if os.path.isfile(path):
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        tokens = [t for rec in records if rec["step"] == picked["step"] for t in rec.get("per_token", [])
                  if t.get("grad_norm") is not None]
    return picked, tokens


def _rms(sums, counts):
    return [math.sqrt(s / c) if c else math.nan for s, c in zip(sums, counts)]


def plot_grad_norm(run_dir: str, out: str, step="last") -> str:
    """One PNG at ``out``: the RMS logit-gradient norm over (log10 p, H) at ``step`` (a heatmap),
    its marginals against log10 p and against H, and the silenced tokens as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    row, tokens = _step_rows(run_dir, step)
    p_edges, h_edges = _grid_axes()
    num_p, num_h = len(p_edges) - 1, len(h_edges) - 1
    sums = np.array(row["grad_norm_grid_sq_sum"]).reshape(num_p, num_h)
    counts = np.array(row["grad_norm_grid_count"]).reshape(num_p, num_h)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.sqrt(sums / counts)
    mesh = axes[0].pcolormesh(h_edges, p_edges, np.log10(rms), cmap="viridis", shading="flat")
    fig.colorbar(mesh, ax=axes[0], label="log10 RMS ||grad||")
    axes[0].set(xlabel="entropy H (nats)", ylabel="log10 p(y)", title=f"step {row['step']}: all trained tokens")
    centres = lambda e: [(a + b) / 2 for a, b in zip(e[:-1], e[1:])]  # noqa: E731
    for ax, xs, marginal, key, label in [
        (axes[1], centres(p_edges), _rms(sums.sum(1), counts.sum(1)), "p", "log10 p(y)"),
        (axes[2], centres(h_edges), _rms(sums.sum(0), counts.sum(0)), "entropy", "entropy H (nats)"),
    ]:
        ax.plot(xs, marginal, marker="o", label="RMS, all trained tokens")
        if tokens:
            tx = [math.log10(t["p"]) if key == "p" else t["entropy"] for t in tokens]
            ax.scatter(tx, [t["grad_norm"] for t in tokens], color="red", s=12, label="silenced tokens")
        ax.set(yscale="log", xlabel=label, ylabel="||d l_t / d logits||")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    share = row.get("grad_share_silenced")
    axes[1].set_title(f"silenced: {row.get('silenced_fraction', math.nan):.3%} of tokens, "
                      f"{share if share is not None else math.nan:.2%} of |grad|^2", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: Optional[List[str]] = None) -> None:
    """``stapo-plot RUN... --out PNG [--keys a,b] [--labels x,y]``, or ``stapo-plot RUN --grad-norm STEP
    --out PNG`` (one run: the gradient-norm figure of a step, STEP a number or "last")."""
    p = argparse.ArgumentParser(prog="stapo-plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (each with a metrics.jsonl)")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--keys", default=",".join(PLOTTED), help=f"comma-separated metrics (default: {','.join(PLOTTED)})")
    p.add_argument("--labels", help="comma-separated legend names, one per run (default: folder names)")
    p.add_argument("--grad-norm", metavar="STEP",
                   help='draw the logit-gradient norm vs p and H of one step ("last" or a number) of one run')
    args = p.parse_args(argv)
    if args.grad_norm is not None:
        if len(args.runs) != 1:
            p.error(f"--grad-norm draws one run, got {len(args.runs)}")
        if args.grad_norm != "last" and not args.grad_norm.isdigit():
            p.error(f"--grad-norm takes a step number or 'last', got {args.grad_norm!r}")
        try:
            print(plot_grad_norm(args.runs[0], args.out, args.grad_norm))
        except ValueError as e:
            p.error(str(e))
        return
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
