"""Tier a: bad input gets a clear error, exit code 2, and nothing complete-looking at the output."""

import json
import os
import shutil
import struct

import pytest
import torch

import conversion.hf_to_mcore as hf_to_mcore
from conversion.cli import main
from stapo_megatron.bridge.tiny import save_tiny_hf_model


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


def _shards(hf_dir):
    return sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))


def _fails(capsys, argv, *needles):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, err
    return err


def _edit_config(hf_dir, **changes):
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3MoeForCausalLM"])
def test_unsupported_architecture(capsys, hf, tmp_path, arch):
    _edit_config(hf, architectures=[arch])
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
           f"unsupported architecture ['{arch}']", "Qwen2ForCausalLM, Qwen3ForCausalLM")
    assert not os.path.exists(tmp_path / "out")


def test_missing_shard(capsys, hf, tmp_path):
    os.remove(os.path.join(hf, _shards(hf)[1]))
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")], _shards(hf)[0][:6], "is missing")
    assert not os.path.exists(tmp_path / "out")


def test_truncated_shard(capsys, hf, tmp_path):
    path = os.path.join(hf, _shards(hf)[0])
    os.truncate(path, os.path.getsize(path) - 1000)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")], "truncated safetensors file")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("damage", ["json", "length"])
def test_corrupt_header(capsys, hf, tmp_path, damage):
    path = os.path.join(hf, _shards(hf)[0])
    with open(path, "r+b") as f:
        if damage == "json":
            f.seek(8)
            f.write(b"#garbage#")
        else:
            f.write(struct.pack("<Q", 2**40))
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")], "corrupt safetensors header")
    assert not os.path.exists(tmp_path / "out")


def test_shape_disagrees_with_config(capsys, hf, tmp_path):
    _edit_config(hf, intermediate_size=128)  # the weights have 96
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
           "model.layers.0.mlp.gate_proj.weight has shape (96, 64) in the checkpoint but the config implies (128, 64)")
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("tp, needle", [(3, "does not divide num_attention_heads 4"),
                                        (4, "does not divide num_query_groups (num_key_value_heads) 2")])
def test_tp_not_dividing_heads_or_groups(capsys, hf, tmp_path, tp, needle):
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out"), "--tp", str(tp)], needle)
    _fails(capsys, ["verify", "--hf-dir", hf, "--ckpt", str(tmp_path / "none"), "--tp", str(tp)], needle)


def test_non_empty_output_needs_overwrite(capsys, hf, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(out)], "exists and is not empty", "--overwrite")
    assert os.listdir(out) == ["keep.txt"]
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / ".metadata").exists()
    back = tmp_path / "back"
    back.mkdir()
    (back / "x").write_text("")
    _fails(capsys, ["mcore-to-hf", "--ckpt", str(out), "--out", str(back)], "exists and is not empty")


@pytest.mark.parametrize("direction", ["hf-to-mcore", "mcore-to-hf"])
def test_interrupted_conversion_leaves_nothing(monkeypatch, hf, tmp_path, direction):
    ckpt = str(tmp_path / "ckpt")
    if direction == "mcore-to-hf":
        assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    calls = {"n": 0}
    real = torch.Tensor.to

    def dying_read(*args, **kwargs):  # the process "dies" half-way through the tensors
        calls["n"] += 1
        if calls["n"] == 10:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", dying_read)
    out = str(tmp_path / "out")
    argv = (["hf-to-mcore", "--hf-dir", hf, "--out", out] if direction == "hf-to-mcore"
            else ["mcore-to-hf", "--ckpt", ckpt, "--out", out])
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    assert calls["n"] >= 10
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.partial")]


def test_incomplete_or_foreign_checkpoint_is_refused(capsys, hf, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(ckpt)]) == 0
    os.remove(ckpt / ".metadata")  # what a save killed before DCP's finish() leaves
    _fails(capsys, ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "back")],
           "not a complete torch_dist checkpoint")
    _fails(capsys, ["mcore-to-hf", "--ckpt", str(tmp_path / "nowhere"), "--out", str(tmp_path / "back")],
           "does not exist")
    assert not os.path.exists(tmp_path / "back")


def test_training_checkpoint_without_hf_config(capsys, hf, tmp_path):
    run = tmp_path / "run"
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(run / "iter_0000007")]) == 0
    shutil.rmtree(run / "iter_0000007" / "hf")
    (run / "latest_checkpointed_iteration.txt").write_text("7")
    _fails(capsys, ["mcore-to-hf", "--ckpt", str(run), "--out", str(tmp_path / "back")], "--hf-config")
    assert main(["mcore-to-hf", "--ckpt", str(run), "--out", str(tmp_path / "back"), "--hf-config", hf]) == 0


def test_stapo_trainer_run_layout(hf, tmp_path):
    # stapo_megatron.checkpoint: <run>/checkpoints/step_*/ and a `latest` marker naming one.
    steps = tmp_path / "run" / "checkpoints"
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(steps / "step_00000010")]) == 0
    (steps / "latest").write_text("step_00000010\n")
    assert main(["mcore-to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "back"), "--hf-config", hf]) == 0
    assert (tmp_path / "back" / "config.json").exists()


def test_checkpoint_shape_disagrees_with_config(capsys, hf, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(ckpt)]) == 0
    _edit_config(str(ckpt / "hf"), num_hidden_layers=3)
    _fails(capsys, ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "back")],
           "has shape (4, 64) but the config implies (3, 64)")


def test_progress_reports_tensors_and_bytes(capsys, hf, tmp_path):
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "ckpt")]) == 0
    err = capsys.readouterr().err
    assert "[hf-to-mcore]" in err and "tensors" in err and "MiB" in err


def test_hf_to_mcore_reads_lazily(monkeypatch, hf, tmp_path):
    # Streaming: the embedding / lm_head (300 x 64 bf16 = 38 KB) are read in row blocks; the
    # largest single read is then one layer's q_proj (128 x 64 bf16 = 16 KB).
    monkeypatch.setattr(hf_to_mcore, "BLOCK_BYTES", 4096)
    sizes = []
    real = hf_to_mcore.read_rows
    monkeypatch.setattr(hf_to_mcore, "read_rows", lambda *a: sizes.append(real(*a).nbytes) or real(*a))
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "ckpt")]) == 0
    assert len(sizes) > 100 and max(sizes) == 128 * 64 * 2
