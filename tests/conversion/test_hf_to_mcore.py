"""Tier a: HF -> Megatron conversion: tensors are read lazily, an integer tensor and too little
free space are refused before anything is written."""

import pytest
import torch

import stapo_megatron.conversion.hf_to_mcore as hf_to_mcore
from stapo_megatron.conversion.cli import main
from tests.helpers.conversion_cli import _fails, hf, tiny_hf  # noqa: F401


def test_hf_to_mcore_reads_lazily(monkeypatch, hf, tmp_path):
    # Streaming: the embedding / lm_head (300 x 64 bf16 = 38 KB) are read in row blocks; the
    # largest single read is then one layer's q_proj (128 x 64 bf16 = 16 KB).
    monkeypatch.setattr(hf_to_mcore, "BLOCK_BYTES", 4096)
    sizes = []
    real = hf_to_mcore.read_rows
    monkeypatch.setattr(hf_to_mcore, "read_rows", lambda *a: sizes.append(real(*a).nbytes) or real(*a))
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "ckpt")]) == 0
    assert len(sizes) > 100 and max(sizes) == 128 * 64 * 2


def test_integer_checkpoint_tensor_is_refused(capsys, hf, tmp_path, monkeypatch):
    ckpt = str(tmp_path / "ckpt")
    real = hf_to_mcore.plan_chunks

    def int_fc2(spec, infos, padded, dtype):
        chunks = real(spec, infos, padded, dtype)
        for c in chunks:
            if c.key == "decoder.layers.mlp.linear_fc2.weight":
                c.dtype = torch.int32
        return chunks

    monkeypatch.setattr(hf_to_mcore, "plan_chunks", int_fc2)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    _fails(capsys, ["mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "back")],
           "checkpoint tensor decoder.layers.mlp.linear_fc2.weight has dtype torch.int32; weights must be floating-point")


def test_too_little_free_space_is_refused_before_writing(capsys, hf, tmp_path):
    from stapo_megatron.conversion.hf_to_mcore import check_free_space

    with pytest.raises(OSError, match="nothing was written"):
        check_free_space(str(tmp_path / "out"), 1 << 62)
