"""The login-node check of every path a job will read, before anything is queued.

A missing model folder, a relative data path or a hub id under ``HF_HUB_OFFLINE=1`` would
otherwise show only after the job's 16-64 GPUs were allocated. The check runs where ``nemo-run``
runs (the login node, or a machine that sees the cluster's shared file system); paths inside a
container are mapped back through the executor's ``src:dst`` mounts first. In a container, every
path the job reads or writes must also lie under a mounted folder (`mount_problems`): the rest is
missing inside it, and an output folder outside them is the container's own temporary file
system, lost with the checkpoints at the end of the job. No nemo_run import.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

JOB_FOLDER = "/nemo_run"
"""Where NeMo-Run mounts the job's own folder inside the container (its code, logs, HF_HOME)."""

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


def _mount_points(mounts: Sequence[str]) -> List[str]:
    """The container side of each ``src[:dst[:flags]]`` mount, and `JOB_FOLDER`."""
    return [(m.partition(":")[2].split(":")[0] or m.partition(":")[0]).rstrip("/") or "/"
            for m in mounts] + [JOB_FOLDER]


def mount_problems(read: Iterable[Tuple[str, str]], output_dir: Optional[str], mounts: Sequence[str]) -> List[str]:
    """Each absolute (setting, path), and ``output_dir``, that no container mount holds, named."""
    points = _mount_points(mounts)

    def mounted(path: str) -> bool:
        return any(p == "/" or path == p or path.startswith(p + "/") for p in points)

    shown = ", ".join(m for m in mounts) or "none besides the job folder"
    hint = ("add its folder to STAPO_CONTAINER_MOUNTS or run.executor.container_mounts "
            f"(e.g. '/lustre:/lustre'; mounts now: {shown})")
    problems = [f"{setting}={path!r} is not under a folder mounted into the container, so the job "
                f"would not find it: {hint}" for setting, path in read if os.path.isabs(path) and not mounted(path)]
    if output_dir and os.path.isabs(output_dir) and not mounted(output_dir):
        problems.append(f"output_dir {output_dir!r} is not under a folder mounted into the container: the "
                        f"checkpoints would go to the container's temporary file system and be lost at the end "
                        f"of the job; {hint}")
    return problems
