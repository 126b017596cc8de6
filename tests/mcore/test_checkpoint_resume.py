"""Checkpoints: atomic publish, resume after SIGKILL at several points, exact continuation."""

import pytest

from stapo_megatron.mcore import checkpoint as ckpt


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
