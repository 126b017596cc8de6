"""Run outputs: metrics.jsonl, TensorBoard, end-of-run plots, the spurious-token inspector.

Only global rank 0 writes. ``metrics.jsonl`` has one JSON object per line: a row per training
step (``kind: "train"``) and a row per held-out evaluation (``kind: "eval"``, with
``eval_accuracy``). ``silenced_tokens.jsonl`` has, per step, the tokens S2T silenced decoded to
text with their count and mean p, H and A, most frequent first (the paper's word-cloud finding
-- digits and math symbols -- is checkable on real runs).
"""

from __future__ import annotations

import collections
import json
import math
import os
import warnings
from typing import Dict, Iterable, List, Optional, Sequence

PLOTTED = ("reward_mean", "entropy_mean", "silenced_fraction", "tau_h", "eval_accuracy")


class RunLogger:
    """Appends metric rows (JSONL + optional TensorBoard) and the inspector's rows."""

    def __init__(self, run_dir: str, enabled: bool = True, tensorboard: bool = True):
        self.run_dir = run_dir
        self.enabled = enabled
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:
                warnings.warn("tensorboard is not installed: metrics go to metrics.jsonl only")

    def resume_from(self, step: int) -> None:
        """Drop what a killed run logged after the checkpoint it resumes from (``step``).

        Rows of ``metrics.jsonl`` and ``silenced_tokens.jsonl`` with a step > ``step`` are
        removed (the resumed run logs those steps again), as is a last line cut off by the kill;
        TensorBoard purges its events after ``step`` too. Each file is rewritten atomically.
        """
        if not self.enabled:
            return
        for name in ("metrics.jsonl", "silenced_tokens.jsonl"):
            truncate_jsonl(os.path.join(self.run_dir, name), step)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(os.path.join(self.run_dir, "tensorboard"), purge_step=step + 1)

    def log(self, row: Dict) -> None:
        if not self.enabled:
            return
        # strict JSON: a NaN (e.g. tau_h with no S2T candidates) is written as null
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                    self._tb.add_scalar(f"{row.get('kind', 'train')}/{key}", value, row["step"])
            self._tb.flush()

    def log_silenced(self, step: int, rows: Sequence[Sequence[float]], decode) -> None:
        """rows: (label id, log p, H, A) of every silenced token of the step."""
        if not self.enabled:
            return
        record = {"step": step, "num_silenced": len(rows), "tokens": summarize_silenced(rows, decode)}
        with open(os.path.join(self.run_dir, "silenced_tokens.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def truncate_jsonl(path: str, step: int) -> int:
    """Keep the rows of a JSONL log whose ``step`` is <= ``step``; returns the number removed.

    A line that does not parse can only be the last one, cut off when the run was killed; it is
    removed too. A missing file is left missing.
    """
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if len(kept) < len(lines):
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(tmp, path)
        warnings.warn(f"{path}: removed {len(lines) - len(kept)} rows logged after step {step} by the run "
                      "this one resumes (they are logged again)")
    return len(lines) - len(kept)


def summarize_silenced(rows: Iterable[Sequence[float]], decode) -> List[Dict]:
    """Group silenced tokens by decoded text: count and mean p, H, A; most frequent first."""
    groups: Dict[str, List] = collections.defaultdict(list)
    for token_id, logprob, entropy, adv in rows:
        groups[decode(int(token_id))].append((math.exp(logprob), entropy, adv))
    out = []
    for text, values in groups.items():
        n = len(values)
        out.append(
            dict(
                token=text,
                count=n,
                p_mean=sum(v[0] for v in values) / n,
                entropy_mean=sum(v[1] for v in values) / n,
                advantage_mean=sum(v[2] for v in values) / n,
            )
        )
    return sorted(out, key=lambda d: (-d["count"], d["token"]))


def read_metrics(run_dir: str) -> List[Dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str, keys: Sequence[str] = PLOTTED) -> Optional[str]:
    """One PNG with a panel per metric vs step (eval rows for eval_accuracy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2))
    for ax, key in zip(axes, keys):
        points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o" if key == "eval_accuracy" else None, markersize=3)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = os.path.join(run_dir, "metrics.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
