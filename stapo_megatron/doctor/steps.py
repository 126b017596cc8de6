"""The doctor's end-to-end row: two STAPO steps of the tiny recipe on the real stack (the rollout
engine, packing, the policy update, the weight sync), timed, in a process of their own.

The steps run as a user's job runs (``torchrun -m stapo_megatron.launch.entry tiny ...``) with the
warm-start and evaluation off and a few prompts, so a broken piece of the stack shows here as it
would on the cluster, in minutes rather than after the queue. The row reads the run's
``metrics.jsonl``: both steps logged, a finite loss, the phases' times and the rollout/training
mismatch.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from stapo_megatron.doctor.report import Check, failed, passed

OVERRIDES = ["steps=2", "prompts_per_step=2", "minibatch_prompts=2", "micro_batch_size=2", "eval.every=0",
             "save_every=0", "warmstart.steps=0", "rollout.group_size=4", "rollout.max_response_len=16"]
"""The tiny recipe, cut to two short steps (the doctor checks the stack, not learning: the random
policy's rewards are 0, so the update's loss is 0, while every phase still runs)."""

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
"""The variables of an enclosing torchrun (``launch/doctor.py``), removed so the steps form their own job."""

PHASES = ("time_rollout", "time_reward", "time_old_logprob", "time_train", "time_weight_sync")


def command(run_dir: str, method: str = "stapo") -> List[str]:
    """The one-process torchrun command of the two steps."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            "-m", "stapo_megatron.launch.entry", "tiny", f"method={method}", f"output_dir={run_dir}", *OVERRIDES]


def read_rows(run_dir: str) -> List[Dict]:
    """The run's training rows (``kind`` "train") from metrics.jsonl, [] when there is none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [r for r in map(json.loads, f) if r.get("kind") == "train"]


def row_from_run(rows: List[Dict], returncode: int, seconds: float, log_tail: str) -> Check:
    """The row of a finished run: fail unless it exited 0 with two finite-loss steps."""
    if returncode != 0:
        return failed("stapo_steps", f"the run exited with {returncode}: {log_tail}", returncode=returncode)
    if len(rows) != 2 or not all(math.isfinite(r["loss"]) for r in rows):
        return failed("stapo_steps", f"expected 2 steps with a finite loss in metrics.jsonl, got "
                                     f"{[(r['step'], r['loss']) for r in rows]}")
    phases = {p: round(sum(r[p] for r in rows), 2) for p in PHASES}
    detail = (f"2 steps in {seconds:.0f} s (" + ", ".join(f"{p[5:]} {s:.1f}s" for p, s in phases.items())
              + f"), mean |delta log p| {max(r['rollout_train_logprob_diff'] for r in rows):.1e}")
    return passed("stapo_steps", detail, wall_s=seconds, **phases,
                  rollout_train_logprob_diff=[r["rollout_train_logprob_diff"] for r in rows])


def check_stapo_steps(timeout_s: float = 900.0, keep_dir: Optional[str] = None) -> Check:
    """Two timed STAPO steps of the tiny recipe in a torchrun job of one process."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = keep_dir or os.path.join(tmp, "run")
        start = time.perf_counter()
        proc = subprocess.run(command(run_dir), env=env, capture_output=True, text=True, timeout=timeout_s)
        seconds = time.perf_counter() - start
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])[-400:]
        return row_from_run(read_rows(run_dir), proc.returncode, seconds, tail)
