"""The resolved configuration as YAML: written by a dry run (``nemo-run ... --save-config PATH``), into
every run folder and every checkpoint (`stapo_megatron.runlog.provenance`), and read back by a launch
(``nemo-run launch/... config=PATH``) or by Python (`load_config`).

The file holds the whole tree, every field with its value, so it documents the run by itself:

    recipe: tiny                  # the recipe it was built from (a launch checks it matches)
    trainer: {run_dir: ..., steps: ..., model: {...}, data: {...}, ...}    # TrainerConfig
    warmstart: {steps: ..., ...}  # WarmStartConfig, or null

Reading goes through the one override parser (`stapo_megatron.config.overrides.apply_overrides`) on
the default configuration, so an edited file is checked like a command line: an unknown field
names the closest ones, a wrongly typed value names the field, and the dataclasses' own checks run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import yaml

from stapo_megatron.config.tree import TrainerConfig
from stapo_megatron.trainer.config import WarmStartConfig
from stapo_megatron.config.overrides import apply_overrides

HEADER = "# stapo-megatron resolved configuration (stapo_megatron/config/yaml_io.py); launch it with config=PATH\n"
KEYS = ("recipe", "trainer", "warmstart")
"""The top-level keys of a configuration file."""


def config_dict(cfg: TrainerConfig, warmstart: Optional[WarmStartConfig] = None,
                recipe: Optional[str] = None) -> Dict[str, Any]:
    """The configuration as plain data (the YAML document)."""
    return {"recipe": recipe, "trainer": dataclasses.asdict(cfg),
            "warmstart": dataclasses.asdict(warmstart) if warmstart is not None else None}


def dump_config(cfg: TrainerConfig, warmstart: Optional[WarmStartConfig] = None, recipe: Optional[str] = None) -> str:
    """The YAML text of a configuration (fields in declaration order)."""
    return HEADER + yaml.safe_dump(config_dict(cfg, warmstart, recipe), sort_keys=False, default_flow_style=False)


def write_config(path: str, cfg: TrainerConfig, warmstart: Optional[WarmStartConfig] = None,
                 recipe: Optional[str] = None) -> str:
    """Write `dump_config` to ``path``; returns ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(dump_config(cfg, warmstart, recipe))
    return path


def parse_config(text: str, where: str = "<config>") -> Tuple[Optional[str], TrainerConfig, Optional[WarmStartConfig]]:
    """(recipe, TrainerConfig, WarmStartConfig or None) of a configuration document.

    Raises:
        ValueError: not YAML, not a mapping with the `KEYS`, or a field the override parser
            refuses (the message names the file and the field).
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{where} is not valid YAML: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("trainer"), dict):
        raise ValueError(f"{where}: expected a mapping with a 'trainer' section (keys {', '.join(KEYS)})")
    unknown = sorted(set(doc) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown top-level key(s) {', '.join(unknown)} (expected {', '.join(KEYS)})")
    try:
        cfg = apply_overrides(TrainerConfig(), doc["trainer"])
        warmstart = doc.get("warmstart")
        if warmstart is not None:
            warmstart = apply_overrides(WarmStartConfig(), warmstart, "warmstart.")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return doc.get("recipe"), cfg, warmstart


def load_config(path: str) -> Tuple[Optional[str], TrainerConfig, Optional[WarmStartConfig]]:
    """`parse_config` of the file ``path``."""
    with open(path, encoding="utf-8") as f:
        return parse_config(f.read(), path)
