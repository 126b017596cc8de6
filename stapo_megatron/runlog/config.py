"""`LoggingConfig`: experiment tracking beside metrics.jsonl (`stapo_megatron.runlog.tracking`)."""

from __future__ import annotations

import dataclasses
from typing import Tuple

from stapo_megatron.utils import check_at_least

@dataclasses.dataclass
class LoggingConfig:
    """Experiment tracking beside ``metrics.jsonl`` (which is always written): see
    ``stapo_megatron.runlog.tracking``. Only global rank 0 logs."""

    backends: Tuple[str, ...] = ("tensorboard",)
    """Any of ``tensorboard``, ``wandb``, ``mlflow``. On the command line a comma-separated list,
    with or without brackets: ``logging.backends=[tensorboard,wandb,mlflow]``."""
    project: str = "stapo-megatron"
    """W&B project and MLflow experiment name."""
    run_name: str = ""
    """The tracking run's display name; empty = the run folder's name."""
    wandb_mode: str = "offline"
    """``offline`` (files under ``<run_dir>/wandb``, upload later with ``wandb sync``; no network
    or account needed) or ``online``."""
    mlflow_tracking_uri: str = ""
    """Where MLflow writes; empty = a local file store ``<run_dir>/mlruns`` (read it with
    ``MlflowClient(tracking_uri=...)`` or ``mlflow ui --backend-store-uri``)."""
    num_samples: int = 8
    """Held-out generations (prompt, response, answer, reward) logged as a table at every eval."""

    def __post_init__(self):
        if isinstance(self.backends, str):
            self.backends = tuple(b.strip() for b in self.backends.strip("[]()").split(",") if b.strip())
        self.backends = tuple(self.backends)
        unknown = [b for b in self.backends if b not in TRACKING_BACKENDS]
        if unknown:
            raise ValueError(f"logging.backends: unknown {unknown}; choose from {list(TRACKING_BACKENDS)}")
        if self.wandb_mode not in ("offline", "online"):
            raise ValueError(f"logging.wandb_mode must be 'offline' or 'online', got {self.wandb_mode!r}")
        check_at_least(self, 0, "num_samples")


TRACKING_BACKENDS = ("tensorboard", "wandb", "mlflow")
"""What `LoggingConfig.backends` may name."""
