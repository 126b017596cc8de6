"""The login-node check of every path a job will read, before anything is queued.

A missing model folder, a relative data path or a hub id under ``HF_HUB_OFFLINE=1`` would
otherwise show only after the job's 16-64 GPUs were allocated. The check runs where ``nemo-run``
runs (the login node, or a machine that sees the cluster's shared file system); paths inside a
container are mapped back through the executor's ``src:dst`` mounts first. No nemo_run import.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""What a Hugging Face hub id looks like (``Qwen/Qwen3-14B-Base``)."""


def paths_read(cfg, config_file: Optional[str] = None) -> List[Tuple[str, str]]:
    """(setting, path) of every file or folder a run of ``cfg`` reads; unset ones are left out."""
    read = [("model.hf_dir", cfg.model.hf_dir), ("model.megatron_ckpt", cfg.model.megatron_ckpt),
            ("data.train_path", cfg.data.train_path), ("data.eval_path", cfg.data.eval_path)]
    read += [(f"eval.sets[{s.name}].path", s.path) for s in cfg.eval.sets]
    read.append(("config", config_file))
    return [(setting, path) for setting, path in read if path]


def host_path(path: str, mounts: Sequence[str]) -> str:
    """``path`` as seen outside the container: the longest mount ``src:dst`` whose dst holds it is
    replaced by its src."""
    best = None
    for mount in mounts:
        src, _, rest = mount.partition(":")
        dst = rest.split(":")[0] or src
        if path == dst or path.startswith(dst.rstrip("/") + "/"):
            if best is None or len(dst) > len(best[1]):
                best = (src, dst)
    return path if best is None else best[0] + path[len(best[1]):]


def path_problems(read: Iterable[Tuple[str, str]], env: Dict[str, str], mounts: Sequence[str] = (),
                  needs_absolute: bool = True) -> List[str]:
    """What is wrong with each (setting, path): relative (with ``needs_absolute``: every node and
    requeued job resolves it against its own working directory), a hub id while the job runs with
    ``HF_HUB_OFFLINE=1``, or missing on this machine."""
    problems = []
    offline = env.get("HF_HUB_OFFLINE", "0") not in ("", "0")
    for setting, path in read:
        if not os.path.isabs(path):
            if setting == "model.hf_dir" and HUB_ID.match(path) and not os.path.exists(path):
                if offline:
                    problems.append(f"{setting}={path!r} is a hub id, but the job runs with HF_HUB_OFFLINE=1 (compute "
                                    "nodes download nothing): download it on the login node "
                                    f"(`hf download {path} --local-dir /shared/models/...`) and give that folder")
                continue
            if needs_absolute:
                problems.append(f"{setting}={path!r} is relative: give an absolute path on a shared file system "
                                "(each node and each requeued job would resolve it against its own working directory)")
                continue
        seen = host_path(path, mounts) if os.path.isabs(path) else path
        if not os.path.exists(seen):
            where = f" (outside the container: {seen})" if seen != path else ""
            problems.append(f"{setting}={path!r} does not exist{where}")
    return problems
