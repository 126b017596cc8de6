"""Run outputs: metrics.jsonl, the tracking backends (TensorBoard, W&B, MLflow:
``stapo_megatron.runlog.tracking``), the plot, held-out samples, the spurious-token inspector.

Only global rank 0 writes. ``metrics.jsonl`` has one JSON object per line: a row per training
step (``kind: "train"``) and a row per held-out evaluation (``kind: "eval"``, with
``eval_accuracy``). ``silenced_tokens.jsonl`` has, per step, the tokens S2T silenced decoded to
text with their count, mean p (the trainer's), p_rollout (the sampler's), H and A and how many
were mismatch-flagged, most frequent first (the paper's word-cloud finding -- digits and math
symbols -- is checkable on real runs), and each silenced token's two probabilities, entropy and
logit-gradient norm before silencing (``per_token``: token, p, p_rollout, flagged, entropy,
grad_norm; ``stapo_megatron.method.rollout_correction``, ``stapo_megatron.ops.logit_grad``). ``samples.jsonl`` has, per eval, the
first held-out generations (prompt, response, answer, reward). ``metrics.png`` is redrawn at
every eval (``stapo_megatron.runlog.plots``).
"""

from __future__ import annotations

import collections
import json
import math
import os
import warnings
from typing import Dict, Iterable, List, Optional, Sequence

from stapo_megatron.runlog.config import LoggingConfig
from stapo_megatron.runlog.plots import plot_run
from stapo_megatron.runlog.tracking import open_trackers

SAMPLE_COLUMNS = ("prompt", "response", "answer", "reward")
"""Columns of the held-out generations table logged at every eval."""

SILENCED_COLUMNS = ("token", "count", "p_mean", "p_rollout_mean", "entropy_mean", "advantage_mean", "flagged",
                    "grad_norm_mean")
"""Columns of the silenced-tokens table (the inspector's summary of the last training step)."""

LOG_FILES = ("metrics.jsonl", "silenced_tokens.jsonl", "samples.jsonl")
"""The JSONL logs of a run folder, one row per step (cut back on resume); a row's ``step`` counts
the steps done (the first step's row says 1, an eval before it 0)."""

STEP_INDEX_LOGS = ("rollout_order.jsonl",)
"""The JSONL logs whose rows name the 0-based step they belong to (cut back on resume): the
stream positions each step trained (`stapo_megatron.trainer.pooled_schedules.StreamingSchedule`)."""


class RunLogger:
    """Appends metric rows (JSONL + the `LoggingConfig` backends) and the inspector's rows.

    With ``plot_every_eval`` an eval row also redraws ``metrics.png``, so the plot follows a
    long run (the trainer's logger does).
    """

    def __init__(self, run_dir: str, enabled: bool = True, tensorboard: bool = True,
                 logging: Optional[LoggingConfig] = None, config=None, plot_every_eval: bool = False):
        """``logging``: the tracking backends (default: TensorBoard, or none with
        ``tensorboard=False``); ``config``: the run's configuration, recorded by W&B / MLflow."""
        self.run_dir = run_dir
        self.enabled = enabled
        self.plot_every_eval = plot_every_eval
        self.logging = logging or LoggingConfig(backends=("tensorboard",) if tensorboard else ())
        self._trackers: List = []
        self._last_silenced: List[Dict] = []
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._trackers = open_trackers(run_dir, self.logging, config)

    def resume_from(self, step: int) -> None:
        """Drop what a killed run logged after the checkpoint it resumes from (``step``).

        Rows of the `LOG_FILES` with a step > ``step`` and of the `STEP_INDEX_LOGS` with a step
        >= ``step`` (the 0-based steps the checkpoint has not trained) are removed (the resumed
        run logs those steps again), as is a last line cut off by the kill; TensorBoard purges
        its events after ``step`` too. Each file is rewritten atomically. W&B and MLflow keep
        theirs.
        """
        if not self.enabled:
            return
        for name in LOG_FILES:
            truncate_jsonl(os.path.join(self.run_dir, name), step)
        for name in STEP_INDEX_LOGS:
            truncate_jsonl(os.path.join(self.run_dir, name), step - 1)
        for tracker in self._trackers:
            tracker.resume_from(step)

    def log(self, row: Dict) -> None:
        if not self.enabled:
            return
        _append_jsonl(os.path.join(self.run_dir, "metrics.jsonl"), row)
        for tracker in self._trackers:
            tracker.log(row)
        if self.plot_every_eval and row.get("kind") == "eval":
            plot_run(self.run_dir)

    def log_silenced(self, step: int, rows: Sequence[Sequence[float]], decode) -> None:
        """rows: (label id, log p, H, A[, log p_rollout, flagged[, grad_norm]]) of every silenced
        token of the step (log p_rollout NaN or absent: the batch had no sampler log-probs;
        grad_norm: ||d l_t / d logits|| before silencing, ``ops.logit_grad``)."""
        if not self.enabled:
            return
        self._last_silenced = summarize_silenced(rows, decode)
        record = {"step": step, "num_silenced": len(rows), "tokens": self._last_silenced,
                  "per_token": [_token_record(row, decode) for row in rows]}
        _append_jsonl(os.path.join(self.run_dir, "silenced_tokens.jsonl"), record)

    def log_samples(self, step: int, samples: Sequence[Dict]) -> None:
        """The first `LoggingConfig.num_samples` held-out generations of an eval (dicts with the
        `SAMPLE_COLUMNS`) into ``samples.jsonl`` and, as tables, into every tracker; with them
        the silenced tokens of the last training step (``eval/silenced_tokens``)."""
        if not self.enabled:
            return
        samples = list(samples)[: self.logging.num_samples]
        _append_jsonl(os.path.join(self.run_dir, "samples.jsonl"), {"step": step, "samples": samples})
        sample_rows = [[s[c] for c in SAMPLE_COLUMNS] for s in samples]
        silenced_rows = [[t[c] for c in SILENCED_COLUMNS] for t in self._last_silenced]
        for tracker in self._trackers:
            tracker.log_table("eval/samples", step, SAMPLE_COLUMNS, sample_rows)
            if silenced_rows:
                tracker.log_table("eval/silenced_tokens", step, SILENCED_COLUMNS, silenced_rows)

    def close(self) -> None:
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []


def _append_jsonl(path: str, row: Dict) -> None:
    """One strict-JSON line (a NaN, e.g. tau_h with no S2T candidates, is written as null)."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    with open(path, "a") as f:
        f.write(json.dumps(clean) + "\n")


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


def _columns(row: Sequence[float]):
    """(token id, p, p_rollout or None, H, A, flagged, grad_norm or None) of one silenced-token row."""
    token_id, logprob, entropy, adv, *rest = row
    rollout_lp = rest[0] if rest else math.nan
    p_rollout = None if math.isnan(rollout_lp) else math.exp(rollout_lp)
    flagged = bool(rest[1]) if len(rest) > 1 else False
    grad_norm = rest[2] if len(rest) > 2 else None
    return int(token_id), math.exp(logprob), p_rollout, entropy, adv, flagged, grad_norm


def _token_record(row: Sequence[float], decode) -> Dict:
    """One silenced token: its text, both probabilities, whether it is mismatch-flagged, its
    entropy and its logit-gradient norm before silencing (None in rows that lack it)."""
    token_id, p, p_rollout, entropy, _, flagged, grad_norm = _columns(row)
    return dict(token=decode(token_id), p=p, p_rollout=p_rollout, flagged=flagged, entropy=entropy,
                grad_norm=grad_norm)


def summarize_silenced(rows: Iterable[Sequence[float]], decode) -> List[Dict]:
    """Group silenced tokens by decoded text: count, mean p, p_rollout, H, A, the number
    mismatch-flagged and the mean logit-gradient norm; most frequent first."""
    groups: Dict[str, List] = collections.defaultdict(list)
    for row in rows:
        token_id, *values = _columns(row)
        groups[decode(token_id)].append(values)
    out = []
    for text, values in groups.items():
        n = len(values)
        rollout_ps = [v[1] for v in values if v[1] is not None]
        norms = [v[5] for v in values if v[5] is not None]
        out.append(
            dict(
                token=text,
                count=n,
                p_mean=sum(v[0] for v in values) / n,
                p_rollout_mean=sum(rollout_ps) / len(rollout_ps) if rollout_ps else None,
                entropy_mean=sum(v[2] for v in values) / n,
                advantage_mean=sum(v[3] for v in values) / n,
                flagged=sum(v[4] for v in values),
                grad_norm_mean=sum(norms) / len(norms) if norms else None,
            )
        )
    return sorted(out, key=lambda d: (-d["count"], d["token"]))
