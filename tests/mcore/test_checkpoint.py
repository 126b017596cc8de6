"""Tier a: checkpoint files are read without executing code. A pickle that would run code when
loaded (its __reduce__ opens a marker file for writing) is refused, and the marker is not written:
DCP's `.metadata` (read by `stapo-convert`, `verify` and the trainer's resume), the trainer
state and the per-rank RNG state."""

import os
import pickle

import pytest
import torch

from stapo_megatron.conversion.cli import main
from stapo_megatron.mcore import checkpoint as ckpt
from stapo_megatron.bridge.tiny import save_tiny_hf_model


class _WritesMarker:
    """Unpickling this calls open(marker, "w"): code execution, made visible."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("safety")
    save_tiny_hf_model(str(root / "hf"), "qwen3")
    assert main(["hf-to-mcore", "--hf-dir", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    return root


def test_planted_dcp_metadata_is_refused(converted, tmp_path, capsys):
    import shutil

    ckpt_dir, marker = tmp_path / "ckpt", tmp_path / "marker"
    shutil.copytree(converted / "ckpt", ckpt_dir)
    assert ckpt.read_dcp_metadata(str(ckpt_dir)).state_dict_metadata  # the genuine file reads
    with open(ckpt_dir / ".metadata", "wb") as f:
        pickle.dump(_WritesMarker(str(marker)), f)
    with pytest.raises(ValueError, match=r"cannot read the checkpoint's .metadata \(UnpicklingError: refusing to "
                                         r"load io.open"):
        ckpt.read_dcp_metadata(str(ckpt_dir))
    assert main(["mcore-to-hf", "--ckpt", str(ckpt_dir), "--out", str(tmp_path / "back")]) == 2
    assert "refusing to load io.open" in capsys.readouterr().err
    assert main(["verify", "--hf-dir", str(converted / "hf"), "--ckpt", str(ckpt_dir)]) == 2
    assert "refusing to load io.open" in capsys.readouterr().err
    assert not marker.exists() and not (tmp_path / "back").exists()


def test_planted_trainer_and_rng_state_are_refused(tmp_path):
    marker = tmp_path / "marker"
    torch.save({"step": 3, "evil": _WritesMarker(str(marker))}, tmp_path / ckpt.TRAINER_STATE)
    with pytest.raises(ValueError, match=r"trainer_state.pt: refused to load \(Weights only load failed"):
        ckpt.read_trainer_state(str(tmp_path))
    torch.save(_WritesMarker(str(marker)), tmp_path / "rng_rank00000.pt")
    with pytest.raises(ValueError, match="rng_rank00000.pt: refused to load"):
        ckpt._torch_load_weights_only(str(tmp_path / "rng_rank00000.pt"))
    assert not marker.exists()


def test_genuine_states_load_weights_only(tmp_path):
    # The RNG state holds numpy's (an ndarray) and Megatron's tracker states: allowed, no code run.
    state = ckpt._rng_state()
    torch.save(state, tmp_path / "rng_rank00000.pt")
    loaded = ckpt._torch_load_weights_only(str(tmp_path / "rng_rank00000.pt"))
    assert loaded["python"] == state["python"] and torch.equal(loaded["torch"], state["torch"])
    assert (loaded["numpy"][1] == state["numpy"][1]).all()
    torch.save({"data_position": 48, "step": 3}, tmp_path / ckpt.TRAINER_STATE)
    assert ckpt.read_trainer_state(str(tmp_path)) == {"data_position": 48, "step": 3}
