"""Tier a: bad input gets a clear error, exit code 2, and nothing complete-looking at the output."""

import json
import re
import os
import shutil
import struct

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.conversion.cli import main
from tests.helpers import REPO_DIR
from tests.helpers.conversion_cli import _fails, hf, tiny_hf  # noqa: F401


def _shards(hf_dir):
    return sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))


def _edit_config(hf_dir, **changes):
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2MoeForCausalLM"])
def test_unsupported_architecture(capsys, hf, tmp_path, arch):
    _edit_config(hf, architectures=[arch])
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
           f"unsupported architecture ['{arch}']", "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM")
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
    assert main(argv) == 130
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
    # stapo_megatron.mcore.checkpoint: <run>/checkpoints/step_*/ and a `latest` marker naming one.
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
    # the tiny checkpoint's few hundred KiB in KiB (whole MiB printed "0/0 MiB")
    assert re.search(r"^\[hf-to-mcore\] (\d+)/\1 tensors, ([\d.]+ KiB)/\2, ", err, re.M), err


def _snapshot(path):
    """{relative path: bytes} of every file under ``path``."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


@pytest.mark.parametrize("where, needle", [("same", "is the input"), ("parent", "contains the input"),
                                           ("inside", "lies inside the input"), ("link", "is the input")])
def test_hf_to_mcore_output_overlapping_input_is_refused(capsys, hf, tmp_path, where, needle):
    # --overwrite would replace the output: with the input at or under it, the model is deleted.
    before = _snapshot(hf)
    (tmp_path / "neighbour").mkdir()
    (tmp_path / "neighbour" / "model.bin").write_text("another model")
    if where == "link":
        os.symlink(hf, tmp_path / "link")
    out = {"same": hf, "parent": str(tmp_path), "inside": os.path.join(hf, "mcore"),
           "link": str(tmp_path / "link")}[where]
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", out, "--overwrite"], needle, out, hf)
    assert _snapshot(hf) == before
    assert (tmp_path / "neighbour" / "model.bin").read_text() == "another model"
    assert not os.path.exists(os.path.join(hf, "mcore"))


@pytest.mark.parametrize("where, needle", [("ckpt", "is the input"), ("step", "is the input"),
                                           ("run_parent", "contains the input"), ("hf_config", "is the input"),
                                           ("inside_step", "lies inside the input")])
def test_mcore_to_hf_output_overlapping_input_is_refused(capsys, hf, tmp_path, where, needle):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000002"
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(step)]) == 0
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    before = _snapshot(str(run))
    out = {"ckpt": run, "step": step, "run_parent": tmp_path, "hf_config": hf, "inside_step": step / "hf"}[where]
    _fails(capsys, ["mcore-to-hf", "--ckpt", str(run), "--out", str(out), "--hf-config", hf, "--overwrite"],
           needle, str(out))
    assert _snapshot(str(run)) == before
    assert os.path.isfile(os.path.join(hf, "config.json"))


_SIGINT_SCRIPT = """
import sys, time
import stapo_megatron.conversion.hf_to_mcore as h
from stapo_megatron.conversion.cli import main
real = h.read_rows
def slow(*a):
    time.sleep(0.05)  # so that SIGINT lands while the writer threads are busy
    return real(*a)
h.read_rows = slow
sys.exit(main(["hf-to-mcore", "--hf-dir", sys.argv[1], "--out", sys.argv[2], "--threads", "3"]))
"""


def test_sigint_during_hf_to_mcore_is_clean(hf, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", _SIGINT_SCRIPT, hf, str(out)], stderr=subprocess.PIPE, text=True,
                            cwd=REPO_DIR)
    deadline = time.monotonic() + 120
    # wait until the writer threads have written into the hidden temporary directory
    while not any(n.startswith(".out.partial") and os.listdir(tmp_path / n) for n in os.listdir(tmp_path)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err
    assert f"stapo-convert hf-to-mcore: interrupted; {out} is left as it was" in err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert os.listdir(tmp_path) == ["hf"]  # neither the output nor the temporary directory


@pytest.mark.parametrize("argv, needle", [
    (["hf-to-mcore", "--hf-dir", "H", "--out", "O", "--tp", "0"], "argument --tp: must be > 0, got 0"),
    (["hf-to-mcore", "--hf-dir", "H", "--out", "O", "--pp", "-1"], "argument --pp: must be > 0, got -1"),
    (["hf-to-mcore", "--hf-dir", "H", "--out", "O", "--threads", "0"], "argument --threads: must be > 0, got 0"),
    (["mcore-to-hf", "--ckpt", "C", "--out", "O", "--max-shard-gb", "nan"], "argument --max-shard-gb: must be > 0"),
    (["verify", "--hf-dir", "H", "--ckpt", "C", "--num-prompts", "0"], "argument --num-prompts: must be > 0, got 0"),
    (["verify", "--hf-dir", "H", "--ckpt", "C", "--tp", "two"], "argument --tp: invalid int value: 'two'"),
])
def test_non_positive_sizes_are_refused(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("change, needle", [
    ({"num_hidden_layers": None}, "required field 'num_hidden_layers' is missing"),
    ({"hidden_size": "64"}, "field 'hidden_size' must be a positive integer, got '64'"),
    ({"num_key_value_heads": 0}, "field 'num_key_value_heads' must be a positive integer, got 0"),
    ({"rms_norm_eps": None}, "required field 'rms_norm_eps' is missing"),
])
def test_config_field_missing_or_malformed(capsys, hf, tmp_path, change, needle):
    path = os.path.join(hf, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key, value in change.items():
        if value is None:
            del cfg[key]
        else:
            cfg[key] = value
    with open(path, "w") as f:
        json.dump(cfg, f)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")], path, needle)
    _fails(capsys, ["verify", "--hf-dir", hf, "--ckpt", str(tmp_path / "none")], path, needle)
    assert not os.path.exists(tmp_path / "out")


def test_config_not_json(capsys, hf, tmp_path):
    with open(os.path.join(hf, "config.json"), "w") as f:
        f.write("{not json")
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")], "config.json: not valid JSON")


@pytest.mark.parametrize("index", [{"metadata": {}}, {"weight_map": ["a"]}, "[1, 2]", "\xff"])
def test_index_without_weight_map(capsys, hf, tmp_path, index):
    path = os.path.join(hf, "model.safetensors.index.json")
    with open(path, "w", encoding="latin-1") as f:
        f.write(index if isinstance(index, str) else json.dumps(index))
    needle = "not valid JSON" if index == "\xff" else "no 'weight_map' object"
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")], path, needle)


def _rewrite_safetensors(hf_dir, fn):
    """Apply ``fn(name, tensor) -> tensor`` to every tensor of every shard (safetensors.torch)."""
    from safetensors.torch import load_file, save_file

    for shard in _shards(hf_dir):
        path = os.path.join(hf_dir, shard)
        save_file({k: fn(k, v).contiguous() for k, v in load_file(path).items()}, path, metadata={"format": "pt"})


def test_integer_weights_are_refused(capsys, hf, tmp_path):
    name = "model.layers.1.mlp.down_proj.weight"
    _rewrite_safetensors(hf, lambda k, v: v.to(torch.int8) if k == name else v)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
           f"tensor {name} has dtype torch.int8; weights must be floating-point")
    assert not os.path.exists(tmp_path / "out")


def test_fp16_overflow_is_refused(capsys, hf, tmp_path):
    name = "model.layers.2.self_attn.o_proj.weight"
    _rewrite_safetensors(hf, lambda k, v: v * 1e6 if k == name else v)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out"), "--dtype", "float16"],
           "decoder.layers.self_attention.linear_proj.weight (chunk at (2, 0, 0))", "overflow float16 (max 65504)")
    assert os.listdir(tmp_path) == ["hf"]
    # bf16 holds the values: the same weights convert, then refuse to export to fp16
    ckpt = str(tmp_path / "ckpt")
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    _fails(capsys, ["mcore-to-hf", "--ckpt", ckpt, "--out", str(tmp_path / "back"), "--dtype", "float16"],
           f"tensor {name}:", "overflow float16 (max 65504)")
    assert not os.path.exists(tmp_path / "back")


@pytest.mark.parametrize("damage", ["distcp", "metadata"])
def test_truncated_checkpoint_files(capsys, hf, tmp_path, damage):
    ckpt = tmp_path / "ckpt"
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(ckpt)]) == 0
    name = ".metadata" if damage == "metadata" else sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0]
    os.truncate(ckpt / name, os.path.getsize(ckpt / name) // 2)
    needle = "cannot read the checkpoint's .metadata" if damage == "metadata" else "is truncated or damaged"
    _fails(capsys, ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "back")], str(ckpt), needle)
    assert not os.path.exists(tmp_path / "back")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".back")]


def test_malformed_iteration_tracker(capsys, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("seven\n")
    _fails(capsys, ["mcore-to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "back")],
           "latest_checkpointed_iteration.txt: expected an iteration number or 'release', got 'seven'")


def test_qwen3_config_without_architectures_converts(hf, tmp_path):
    """A config saved from a bare PretrainedConfig has only ``model_type``: it is Qwen3."""
    path = os.path.join(hf, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    del cfg["architectures"]
    assert cfg["model_type"] == "qwen3"
    with open(path, "w") as f:
        json.dump(cfg, f)
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")]) == 0
    with open(tmp_path / "out" / "stapo_conversion.json") as f:
        assert json.load(f)["architecture"] == "Qwen3ForCausalLM"


def test_gpt2_config_is_refused_for_its_architecture(capsys, hf, tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(hf)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
           "unsupported architecture ['GPT2LMHeadModel']", "Qwen2ForCausalLM, Qwen3ForCausalLM")
    assert not os.path.exists(tmp_path / "out")


def test_config_with_fewer_layers_than_the_weights_is_refused(capsys, hf, tmp_path):
    with open(os.path.join(hf, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    _edit_config(hf, num_hidden_layers=layers - 1)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
           f"weights of layers {layers - 1}..{layers - 1}", f"num_hidden_layers is {layers - 1}")
    assert not os.path.exists(tmp_path / "out")


def test_fp8_weights_are_named_as_an_unsupported_dtype(capsys, hf, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite_safetensors(hf, lambda k, v: v.to(torch.float8_e4m3fn) if k == name else v)
    err = _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
                 f"tensor '{name}' has dtype F8_E4M3 (FP8 (E4M3)), which is not supported")
    assert "corrupt" not in err
    assert not os.path.exists(tmp_path / "out")


def test_mcore_to_hf_given_a_file_says_so(capsys, hf, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert main(["hf-to-mcore", "--hf-dir", hf, "--out", str(ckpt)]) == 0
    target = str(ckpt / "common.pt")
    err = _fails(capsys, ["mcore-to-hf", "--ckpt", target, "--out", str(tmp_path / "back")],
                 f"checkpoint path {target} is a file, not a checkpoint directory", f"e.g. {ckpt}")
    assert "does not exist" not in err


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(capsys, hf, tmp_path, value):
    name = "model.layers.1.self_attn.k_proj.weight"

    def damage(k, v):
        if k == name:
            v = v.clone()
            v[3, 1] = value
        return v

    _rewrite_safetensors(hf, damage)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", hf, "--out", str(tmp_path / "out")],
           f"tensor {name}", "non-finite values", "damaged")
    assert sorted(os.listdir(tmp_path)) == ["hf"]


def test_disk_filling_up_during_hf_to_mcore(hf, tmp_path):
    """A real write failure: the conversion runs in a process whose file size limit (RLIMIT_FSIZE,
    SIGXFSZ ignored) is below the checkpoint's size, so the writes fail as on a full disk."""
    import subprocess
    import sys

    out = tmp_path / "out"
    script = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))\n"
        "from stapo_megatron.conversion.cli import main\n"
        f"sys.exit(main(['hf-to-mcore', '--hf-dir', {hf!r}, '--out', {str(out)!r}]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert "writing the checkpoint failed (the disk is full or a file size limit was reached)" in proc.stderr
    assert str(out) in proc.stderr
    assert "inline_container" not in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no output, no staged folder


def test_too_little_free_space_is_refused_before_writing(capsys, hf, tmp_path):
    from stapo_megatron.conversion.hf_to_mcore import check_free_space

    with pytest.raises(OSError, match=r"needs 4.00 EiB but the file system of .* free \(.* more needed\); nothing was "
                                      r"written"):
        check_free_space(str(tmp_path / "out"), 1 << 62)


def test_conversion_onto_a_full_disk_names_the_sizes(hf, tmp_path):
    """A real full file system: a 64 KiB tmpfs, filled, mounted in a user and mount namespace of
    the converter's process (the sizes were printed as "0.00 GiB" either side)."""
    import subprocess
    import sys

    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f"mount -t tmpfs -o size=64k tmpfs {disk}"
    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount],
                      capture_output=True).returncode:
        pytest.skip("no user namespaces here to mount a small tmpfs in")
    convert = f"from stapo_megatron.conversion.cli import main; raise SystemExit(main(['hf-to-mcore', " \
              f"'--hf-dir', {hf!r}, '--out', {str(disk / 'ckpt')!r}]))"
    script = f"{mount} && (cat /dev/zero > {disk}/fill 2>/dev/null; df -B1 --output=avail {disk} | tail -1; " \
             f"exec {sys.executable} -c \"{convert}\")"
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                          capture_output=True, text=True, timeout=600)
    assert proc.stdout.split() == ["0"], proc.stdout + proc.stderr  # the disk is full
    assert proc.returncode == 2, proc.stderr
    needed = re.search(r"the checkpoint needs ([\d.]+ KiB) but the file system of (.*) has 0 B free "
                       r"\(\1 more needed\); nothing was written", proc.stderr)
    assert needed and needed.group(2) == str(disk), proc.stderr
    assert 64 < float(needed.group(1).split()[0]) < 1024  # the tiny checkpoint: more than the disk, < 1 MiB
    assert "Traceback" not in proc.stderr


@pytest.fixture
def qwen35_hf(tmp_path):
    path = str(tmp_path / "qwen35")
    save_tiny_hf_model(path, "qwen3.5")
    return path


def test_qwen35_unmapped_layer_type_is_refused_naming_the_field(capsys, qwen35_hf, tmp_path):
    _edit_config(qwen35_hf, layer_types=["linear_attention", "linear_attention", "mamba", "full_attention"])
    _fails(capsys, ["hf-to-mcore", "--hf-dir", qwen35_hf, "--out", str(tmp_path / "out")],
           "config.json: layer_types entry 'mamba' (layer 2) is not mapped")
    assert not os.path.exists(tmp_path / "out")


def test_qwen35_vision_checkpoint_and_vision_tensors_are_refused(capsys, qwen35_hf, tmp_path):
    """A vision-language config over a text model's tensors (``model.layers.*``, not its text
    tower's ``model.language_model.*``) is refused naming a tensor; a text config over a checkpoint
    that still holds the vision tower is refused too (its tensors would be dropped), naming a tensor."""
    with open(os.path.join(qwen35_hf, "config.json")) as f:
        text = json.load(f)
    vl = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
          "vision_config": {"depth": 2, "hidden_size": 32}}
    with open(os.path.join(qwen35_hf, "config.json"), "w") as f:
        json.dump(vl, f)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", qwen35_hf, "--out", str(tmp_path / "a")],
           "tensors outside its text tower (model.language_model.*, lm_head.*, mtp.*) and vision tower "
           "(model.visual.*), e.g. ['model.embed_tokens.weight'")
    with open(os.path.join(qwen35_hf, "config.json"), "w") as f:
        json.dump(text, f)
    from safetensors.torch import save_file

    save_file({"model.visual.blocks.0.attn.qkv.weight": torch.zeros(96, 32)},
              os.path.join(qwen35_hf, "visual.safetensors"), metadata={"format": "pt"})
    index = os.path.join(qwen35_hf, "model.safetensors.index.json")
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    weight_map["model.visual.blocks.0.attn.qkv.weight"] = "visual.safetensors"
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", qwen35_hf, "--out", str(tmp_path / "b")],
           "1 vision-tower tensors (e.g. model.visual.blocks.0.attn.qkv.weight)", "would drop them")
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_qwen35_tp_must_divide_delta_net_heads(capsys, qwen35_hf, tmp_path):
    _edit_config(qwen35_hf, linear_num_key_heads=1, linear_num_value_heads=4)
    _fails(capsys, ["hf-to-mcore", "--hf-dir", qwen35_hf, "--out", str(tmp_path / "out"), "--tp", "2"],
           "tensor_model_parallel_size 2 does not divide linear_num_key_heads 1")
