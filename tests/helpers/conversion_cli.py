"""What the converter's command-line tests share: a sharded tiny Qwen3 HF folder (a module fixture)
and a per-test copy of it to damage, a refused command's exit code and message, and a round trip
HF -> Megatron -> HF through the command line."""

import shutil

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.conversion.cli import main


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A sharded tiny Qwen3 HF folder (3+ safetensors files); tests copy it before damaging it."""
    path = str(tmp_path_factory.mktemp("src") / "hf")
    save_tiny_hf_model(path, "qwen3", max_shard_size="100KB")
    return path


@pytest.fixture
def hf(tiny_hf, tmp_path):
    dst = str(tmp_path / "hf")
    shutil.copytree(tiny_hf, dst)
    return dst


def _fails(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


def _roundtrip(tmp_path, variant, dtype=torch.bfloat16, hf_shard="50GB", extra_to=(), extra_back=()):
    hf, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    save_tiny_hf_model(hf, variant, dtype=dtype, max_shard_size=hf_shard)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt, *extra_to]) == 0
    assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back, *extra_back]) == 0
    return hf, ckpt, back
