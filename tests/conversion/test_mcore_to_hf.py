"""Tier a: Megatron -> HF conversion on a full disk: a message naming it, and nothing left behind."""

import os

from stapo_megatron.conversion.cli import main
from tests.helpers.conversion_cli import _fails, hf, tiny_hf  # noqa: F401


def test_full_disk_is_a_message_and_leaves_nothing(capsys, monkeypatch, hf, tmp_path):
    import errno

    import stapo_megatron.conversion.mcore_to_hf as mcore_to_hf

    ckpt = str(tmp_path / "ckpt")
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0

    def full(self, piece):
        raise OSError(errno.ENOSPC, "No space left on device", self.path)

    monkeypatch.setattr(mcore_to_hf.ShardWriter, "write", full)
    _fails(capsys, ["mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "back")],
           "error: [Errno 28] No space left on device:", "model.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]
