"""Checkpoints: atomic publish, resume after SIGKILL at several points, exact continuation."""

import json
import os
import subprocess
import sys
import tempfile
import uuid

import pytest

from stapo_megatron.mcore import checkpoint as ckpt

SCRIPT = os.path.join(os.path.dirname(__file__), "ckpt_train_script.py")
STEPS = 6


def _run(run_dir, kill_at=""):
    """torchrun the script to its end, or until its ranks kill themselves at ``kill_at``.

    A rank killed inside a checkpoint save orphans the helper process it had spawned there (it
    keeps the rank's stderr open and never exits): every process of the launch carries a marker
    in its environment, and whatever is left of it afterwards is killed.
    """
    from tests.dist_utils import _free_port, kill_marked

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_free_port()}",
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


@pytest.mark.slow
def test_sigkill_and_resume_reproduces_uninterrupted_run(tmp_path):
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "killed"
    _run_to_end(ref_dir)
    reference = {r["step"]: r for r in _rows(ref_dir)}
    assert sorted(reference) == list(range(1, STEPS + 1))

    # The job crashes where the run itself says (every rank SIGKILLs itself there), never at a
    # wall-clock moment: inside step 2's policy update, then (resumed from step 1) inside step
    # 4's checkpoint save, after the shards are written and before the checkpoint is published.
    for kill_at, expect_latest in (("update:2", "step_00000001"), ("save:4", "step_00000003")):
        returncode, err = _run(run_dir, kill_at)
        assert returncode != 0, f"the job killed at {kill_at} exited 0"
        latest = ckpt.find_latest(str(run_dir), world_size=2)
        assert latest is not None and ckpt._is_complete(latest, 2), err
        assert os.path.basename(latest) == expect_latest, (kill_at, latest)
    assert os.path.isdir(run_dir / "checkpoints" / ".tmp_step_00000004")  # the save really was cut
    _run_to_end(run_dir)

    rows = _rows(run_dir)
    resumes = [r["resumed"] for r in rows if r["resumed"]]
    assert set(resumes) == {"step_00000001", "step_00000003"}, f"expected two resumes, saw {set(resumes)}"
    final = {}
    for r in rows:  # a step re-run after a kill overwrites the earlier row
        final[r["step"]] = r
    assert sorted(final) == list(range(1, STEPS + 1))
    for step, r in final.items():
        # same seeds, same CPU kernels, optimizer/RNG state restored exactly: bit-identical
        assert r["loss"] == reference[step]["loss"], step
        assert r["grad_norm"] == reference[step]["grad_norm"], step
        assert r["noise"] == reference[step]["noise"], step
    # no temporary directory left looking like a checkpoint
    names = os.listdir(run_dir / "checkpoints")
    assert all(not n.startswith("step_") or ckpt._is_complete(str(run_dir / "checkpoints" / n), 2) for n in names)


def test_find_latest_ignores_incomplete(tmp_path):
    root = tmp_path / "checkpoints"
    good, bad = root / "step_00000002", root / "step_00000003"
    for d in (good, bad):
        d.mkdir(parents=True)
    for name in (".metadata", ckpt.TRAINER_STATE, "rng_rank00000.pt"):
        (good / name).write_text("x")
    (bad / ".metadata").write_text("x")  # killed before trainer state / RNG files
    (root / ckpt.LATEST).write_text("step_00000003\n")
    assert ckpt.find_latest(str(tmp_path), world_size=1) == str(good)
    assert ckpt.find_latest(str(tmp_path / "nothing"), world_size=1) is None
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpt.load_checkpoint(str(bad), None, None)
