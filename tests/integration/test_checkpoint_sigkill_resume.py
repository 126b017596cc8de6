"""Checkpoints: atomic publish, resume after SIGKILL at several points, exact continuation: the
multi-process and end-to-end tests (the single-process ones are in
``tests/mcore/test_checkpoint_resume.py``)."""

import os
import pytest
from stapo_megatron.mcore import checkpoint as ckpt
from tests.helpers.checkpoint_runs import STEPS, _rows, _run, _run_to_end  # noqa: F401


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
