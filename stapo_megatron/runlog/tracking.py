"""Experiment tracking beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

`open_trackers` builds the backends `LoggingConfig.backends` names. Each has the same calls:
``log(row)`` (a metrics row of ``metrics.jsonl``: numbers go in as ``<kind>/<key>`` at the row's
``step``), ``log_table(name, step, columns, rows)``, ``resume_from(step)`` and ``close()``.

W&B runs offline by default (files under ``<run_dir>/wandb``; ``wandb sync <run_dir>/wandb/offline-run-*``
uploads them later) and MLflow writes a local file store ``<run_dir>/mlruns``. The ids of the W&B
and MLflow runs are kept in ``<run_dir>/tracking.json``, so a resumed run (same run folder)
continues the same tracking runs instead of starting new ones.

The trainer's ``step`` is the x axis everywhere. W&B's own step counter only grows (a resumed run
re-logs the steps after its checkpoint, and offline it cannot know the counter it had), so W&B
charts use the logged ``step`` as their x axis (``define_metric``) and W&B's counter is unused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence

TRACKING_FILE = "tracking.json"
"""Run-folder file with the tracking runs' ids: ``{"wandb": ..., "mlflow": ...}``."""

MLFLOW_PARAM_MAX_CHARS = 6000
"""MLflow refuses parameter values longer than this (``MAX_PARAM_VAL_LENGTH``); longer ones are cut."""


def _numbers(row: Dict) -> Dict[str, float]:
    """The finite numeric values of a metrics row as ``<kind>/<key>`` (``step`` itself left out)."""
    kind = row.get("kind", "train")
    return {f"{kind}/{key}": float(value) for key, value in row.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step"
            and math.isfinite(value)}


def flatten(config: Dict, prefix: str = "") -> Dict[str, Any]:
    """A nested dict as dotted keys: ``{"loss": {"tau_p": 0.002}}`` -> ``{"loss.tau_p": 0.002}``."""
    out: Dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_run_ids(run_dir: str) -> Dict[str, str]:
    """The tracking run ids stored in ``run_dir`` (empty for a new run folder)."""
    path = os.path.join(run_dir, TRACKING_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _store_run_id(run_dir: str, backend: str, run_id: str) -> None:
    """Add ``backend``'s run id to ``tracking.json`` (written atomically)."""
    ids = {**read_run_ids(run_dir), backend: run_id}
    path = os.path.join(run_dir, TRACKING_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(ids, f, indent=1)
    os.replace(path + ".tmp", path)


class TensorBoardTracker:
    """Scalars under ``<run_dir>/tensorboard``; tables as Markdown text."""

    def __init__(self, run_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(run_dir, "tensorboard")
        self.writer = SummaryWriter(self.log_dir)

    def resume_from(self, step: int) -> None:
        """Purge the events a killed run wrote after ``step`` (they are logged again)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(self.log_dir, purge_step=step + 1)

    def log(self, row: Dict) -> None:
        for key, value in _numbers(row).items():
            self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def log_table(self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        lines += ["| " + " | ".join(str(v).replace("|", "\\|").replace("\n", " ") for v in r) + " |" for r in rows]
        self.writer.add_text(name, "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run (offline by default) under ``<run_dir>/wandb``, resumed by id."""

    def __init__(self, run_dir: str, cfg, config: Dict, run_id: Optional[str]):
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.project, name=cfg.run_name or os.path.basename(os.path.abspath(run_dir)),
            dir=run_dir, mode=cfg.wandb_mode, id=run_id, resume="allow" if run_id else None, config=config,
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id = self.run.id
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def resume_from(self, step: int) -> None:
        """Nothing to drop: W&B keeps what the killed run logged; the steps after ``step`` are
        logged again (charts plot against ``step``)."""

    def log(self, row: Dict) -> None:
        self.run.log({"step": row["step"], **_numbers(row)})

    def log_table(self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        table = self._wandb.Table(columns=list(columns), data=[list(r) for r in rows])
        self.run.log({"step": step, name: table})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run (a local file store ``<run_dir>/mlruns`` by default), resumed by id."""

    def __init__(self, run_dir: str, cfg, config: Dict, run_id: Optional[str]):
        self.uri = cfg.mlflow_tracking_uri or "file://" + os.path.abspath(os.path.join(run_dir, "mlruns"))
        if self.uri.startswith("file:"):
            # mlflow 3.x (3.17 here) refuses the file store ("maintenance mode") unless this is
            # set; it is the local store that needs no server or database package, which
            # mlflow-skinny does not install.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id:
            self.client.update_run(run_id, status="RUNNING")  # raises if the store does not have it
            self.run_id = run_id
        else:
            self.run_id = self._create_run(cfg, run_dir, config)

    def _create_run(self, cfg, run_dir: str, config: Dict) -> str:
        experiment = self.client.get_experiment_by_name(cfg.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.project)
        run = self.client.create_run(experiment_id,
                                     run_name=cfg.run_name or os.path.basename(os.path.abspath(run_dir)))
        from mlflow.entities import Param

        params = [Param(key, str(value)[:MLFLOW_PARAM_MAX_CHARS]) for key, value in flatten(config).items()]
        for start in range(0, len(params), 100):  # log_batch takes at most 100 params a call
            self.client.log_batch(run.info.run_id, params=params[start:start + 100])
        return run.info.run_id

    def resume_from(self, step: int) -> None:
        """Nothing to drop: MLflow keeps the killed run's values; the steps after ``step`` are
        logged again (a metric's history then has two values at those steps)."""

    def log(self, row: Dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, row["step"]) for key, value in _numbers(row).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def log_table(self, name: str, step: int, columns: Sequence[str], rows: Sequence[Sequence]) -> None:
        # the layout MlflowClient.log_table writes (pandas "split"), without needing pandas
        self.client.log_dict(self.run_id, {"columns": list(columns), "data": [list(r) for r in rows]},
                             f"{name}/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_trackers(run_dir: str, cfg, config: Any) -> List:
    """The trackers ``cfg.backends`` (a `LoggingConfig`) names, W&B and MLflow resumed from the
    run ids in ``<run_dir>/tracking.json`` where there are any (and stored there when new).

    ``config`` (a dataclass such as `TrainerConfig`, or a dict) is recorded as the run's
    configuration (W&B config, MLflow params).
    """
    config = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config or {})
    ids = read_run_ids(run_dir)
    trackers = []
    for backend in cfg.backends:
        if backend == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir))
            continue
        kind = {"wandb": WandbTracker, "mlflow": MlflowTracker}[backend]
        tracker = kind(run_dir, cfg, config, ids.get(backend))
        if ids.get(backend) != tracker.run_id:
            _store_run_id(run_dir, backend, tracker.run_id)
        trackers.append(tracker)
    return trackers
