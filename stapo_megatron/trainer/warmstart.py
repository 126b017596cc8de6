"""The warm-start cache: a supervised warm-start trained once and reused by every run of a recipe.

The CPU demo starts RL from a tiny model warm-started on worked answers (``recipes/tiny.py``).
Trained from the same seeds, on the same data and parallel layout, the warm-start gives the
same weights every time, so it is trained once and kept in ``WarmStartConfig.cache_dir``
(git-ignored ``.cache/warmstart`` in the demo) under a key that hashes everything that
determines it. The recipe is the source of truth and the cache only saves time: a changed recipe
gives a new key (a new folder), and deleting the folder retrains the same weights.

Written like every model-only save (`checkpoint.save_model_only`): to a temporary sibling,
renamed when complete, so an interrupted warm-start never leaves a folder that looks cached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Optional

from stapo_megatron.config import TrainerConfig, WarmStartConfig

_FORMAT = 1
"""Bumped when what the key covers or the folder layout changes."""


def _file_digest(path: str) -> str:
    if not os.path.exists(path):
        return "absent"
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cache_key(cfg: TrainerConfig, warmstart: WarmStartConfig, seed: int, data_seed: int, world_size: int) -> str:
    """A short hash of what determines the warm-started weights.

    Covers the warm-start config (but not where it is cached or copied), its seed, the data
    config and its seed, the model folder's ``config.json`` and tokenizer, the parallel layout
    and world size, the micro-batch size and the optimizer settings the SFT inherits (all but
    the learning rate and weight decay, which the warm-start sets itself).
    """
    ws = dataclasses.asdict(dataclasses.replace(warmstart, cache_dir="", save_to="", seed=None))
    optim = {k: v for k, v in dataclasses.asdict(cfg.optim).items() if k not in ("lr", "weight_decay")}
    model = dict(tp=cfg.model.tensor_model_parallel_size, pp=cfg.model.pipeline_model_parallel_size,
                 bf16=cfg.model.bf16, config=_file_digest(os.path.join(cfg.model.hf_dir, "config.json")),
                 tokenizer=_file_digest(os.path.join(cfg.model.hf_dir, "tokenizer.json")),
                 megatron_ckpt=cfg.model.megatron_ckpt)
    data = dataclasses.asdict(dataclasses.replace(cfg.data, seed=None))
    payload = dict(format=_FORMAT, warmstart=ws, seed=seed, data=data, data_seed=data_seed, model=model,
                   optim=optim, micro_batch_size=cfg.micro_batch_size, world_size=world_size)
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_path(cfg: TrainerConfig, warmstart: Optional[WarmStartConfig], seed: int, data_seed: int,
                world_size: int) -> Optional[str]:
    """``<cache_dir>/warmstart-<key>`` when the warm-start is cached, else None."""
    if warmstart is None or not warmstart.steps or not warmstart.cache_dir:
        return None
    key = cache_key(cfg, warmstart, seed, data_seed, world_size)
    return os.path.join(warmstart.cache_dir, f"warmstart-{key}")


def is_complete(path: str) -> bool:
    """A cached warm-start is complete once its folder exists (it is renamed into place whole)."""
    return os.path.isfile(os.path.join(path, ".metadata"))
