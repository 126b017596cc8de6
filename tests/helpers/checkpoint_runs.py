"""The checkpoint tests' training job: torchrun ``ckpt_train_script.py`` on two ranks (to its end,
or until its ranks kill themselves at a given point) and read the losses it logged."""

import json
import os
import subprocess
import sys
import tempfile
import uuid

from tests.helpers import HELPERS_DIR

SCRIPT = os.path.join(HELPERS_DIR, "ckpt_train_script.py")

STEPS = 6


def _run(run_dir, kill_at=""):
    """torchrun the script to its end, or until its ranks kill themselves at ``kill_at``.

    A rank killed inside a checkpoint save orphans the helper process it had spawned there (it
    keeps the rank's stderr open and never exits): every process of the launch carries a marker
    in its environment, and whatever is left of it afterwards is killed.
    """
    from tests.helpers.dist_utils import free_port, kill_marked

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           SCRIPT, str(run_dir), str(STEPS)] + ([kill_at] if kill_at else [])
    marker = f"{os.getpid()}-{uuid.uuid4().hex}"
    env = dict(os.environ, OMP_NUM_THREADS="1", STAPO_TEST_LAUNCH=marker)
    with tempfile.TemporaryFile() as err:
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, timeout=600)
        kill_marked(marker)
        err.seek(0)
        return proc.returncode, err.read().decode(errors="replace")[-3000:]


def _rows(run_dir):
    path = os.path.join(run_dir, "losses.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _run_to_end(run_dir):
    returncode, err = _run(run_dir)
    assert returncode == 0, err
