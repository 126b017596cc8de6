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


def test_the_checkpoint_writer_outlives_the_warning_signal(monkeypatch):
    """megatron-core's checkpoint writer keeps a spawned Manager process from the first save on;
    Slurm's warning signal reaches every process of the job, and by default it would end the
    Manager, so the save the signal asks for failed with a broken pipe. It is started ignoring
    the signal: a real SIGUSR1 leaves it running and its queue working, and this process's own
    handler is kept."""
    import signal

    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from stapo_megatron.mcore.mcore_versions import checkpoint_writer_queue

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # a fresh Manager, as at a run's first save
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    handler = signal.signal(signal.SIGUSR1, lambda *a: None)
    try:
        ckpt._start_writer_ignoring_warning()
        assert signal.getsignal(signal.SIGUSR1) not in (signal.SIG_IGN, signal.SIG_DFL)  # ours, restored
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
        assert started, "no Manager process was started"
        for process in started:
            os.kill(process.pid, signal.SIGUSR1)
        for process in started:  # a killed process would be reaped at once; a live one times out
            with pytest.raises(psutil.TimeoutExpired):
                process.wait(timeout=2)
        queue = checkpoint_writer_queue()
        queue.put("still there")
        assert queue.get(timeout=10) == "still there"
    finally:
        signal.signal(signal.SIGUSR1, handler)
