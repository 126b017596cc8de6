"""Tier a: HF -> Megatron torch_dist -> HF through the CLI is bit-exact, per Qwen variant."""

import json
import os

import pytest
import torch

from stapo_megatron.conversion.dcp_io import CheckpointReader
from stapo_megatron.conversion.safetensors_io import index_checkpoint
from stapo_megatron.bridge.tiny import save_tiny_hf_model
from tests.helpers import REPO_DIR
from tests.helpers.conversion_parity import _assert_bit_exact
from tests.helpers.conversion_cli import _roundtrip


@pytest.mark.parametrize("variant", ["qwen2", "qwen2.5", "qwen3", "qwen3-tied", "qwen3.5", "qwen3.5-tied",
                                     "qwen3.5-moe"])
def test_roundtrip_bf16_bit_exact(tmp_path, variant):
    hf, ckpt, back = _roundtrip(tmp_path, variant)
    _assert_bit_exact(hf, back)
    with open(os.path.join(back, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == json.load(open(os.path.join(hf, "config.json")))["architectures"]
    assert cfg["dtype"] == "bfloat16"
    assert os.path.isfile(os.path.join(back, "generation_config.json"))


def test_roundtrip_fp32_and_dtype_change(tmp_path):
    hf, _, back = _roundtrip(tmp_path / "a", "qwen2", dtype=torch.float32)
    _assert_bit_exact(hf, back)
    # bf16 -> stored fp32 -> bf16 is exact as well.
    hf, ckpt, back = _roundtrip(tmp_path / "b", "qwen3", extra_to=["--dtype", "float32"],
                                extra_back=["--dtype", "bfloat16"])
    assert CheckpointReader(ckpt).tensors()["output_layer.weight"].properties.dtype == torch.float32
    _assert_bit_exact(hf, back)


def test_sharded_input_and_output_load_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    hf, _, back = _roundtrip(tmp_path, "qwen2.5", hf_shard="300KB", extra_back=["--max-shard-gb", str(400e3 / 2**30)])
    assert len({i.path for i in index_checkpoint(hf).values()}) > 1
    with open(os.path.join(back, "model.safetensors.index.json")) as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    _assert_bit_exact(hf, back)
    tokens = torch.arange(12).unsqueeze(0)
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(tokens).logits
    got = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)(tokens).logits
    assert torch.equal(ref, got)


def test_top_level_conversion_scripts_are_the_cli(tmp_path):
    """``python conversion/hf_to_mcore.py`` and ``conversion/mcore_to_hf.py`` (the entry scripts a user
    runs from a checkout) do what ``stapo-convert hf-to-mcore`` / ``mcore-to-hf`` do: a bit-exact round
    trip, and their usage errors exit with the CLI's code 2."""
    import subprocess
    import sys

    repo = REPO_DIR
    hf, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    save_tiny_hf_model(hf, "qwen3")

    def script(name, *args):
        return subprocess.run([sys.executable, os.path.join(repo, "conversion", name), *args],
                              capture_output=True, text=True, timeout=600)

    assert script("hf_to_mcore.py", "--hf-dir", hf, "--out", ckpt).returncode == 0
    assert script("mcore_to_hf.py", "--ckpt", ckpt, "--out", back).returncode == 0
    _assert_bit_exact(hf, back)
    bad = script("verify.py", "--hf-dir", hf)  # --ckpt missing: argparse's usage error
    assert bad.returncode == 2 and "stapo-convert verify" in bad.stderr and "--ckpt" in bad.stderr


def test_qwen35_roundtrip_at_tp2_keeps_mtp_and_loads_in_transformers(tmp_path):
    """Qwen3.5 (delta-net layers, gated attention) converted for TP=2: bit-exact back, the MTP
    tensors (which transformers' model does not build) carried through, and the export gives
    transformers' logits exactly."""
    from transformers import AutoModelForCausalLM

    hf, ckpt, back = _roundtrip(tmp_path, "qwen3.5", dtype=torch.float32, extra_to=["--tp", "2"])
    _assert_bit_exact(hf, back)  # the mtp.* tensors included
    stored = CheckpointReader(ckpt).tensors()
    assert "hf_carried.mtp.fc.weight" in stored and "decoder.layers.3.self_attention.linear_qkv.weight" in stored
    assert tuple(stored["decoder.layers.0.self_attention.in_proj.weight.z"].size) == (64, 64)  # 4 heads x 16
    tokens = torch.arange(12).unsqueeze(0)
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(tokens).logits
    got = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)(tokens).logits
    assert torch.equal(ref, got)


def test_checkpoint_without_mtp_exports_with_a_warning(tmp_path):
    """A checkpoint that carries no MTP tensors (as a training checkpoint) exports the text model
    and says that the MTP weights are missing."""
    from stapo_megatron.conversion.cli import main

    hf, ckpt, back = (str(tmp_path / n) for n in ("hf", "ckpt", "back"))
    save_tiny_hf_model(hf, "qwen3.5")
    os.remove(os.path.join(hf, "mtp.safetensors"))
    index = os.path.join(hf, "model.safetensors.index.json")
    with open(index) as f:
        weight_map = {n: f for n, f in json.load(f)["weight_map"].items() if not n.startswith("mtp.")}
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with pytest.warns(UserWarning, match="mtp_num_hidden_layers=1 but the checkpoint holds no mtp"):
        assert main(["hf-to-mcore", "--hf-dir", hf, "--out", ckpt]) == 0
    with pytest.warns(UserWarning, match="carries no mtp.* tensors"):
        assert main(["mcore-to-hf", "--ckpt", ckpt, "--out", back]) == 0
    exported = index_checkpoint(back)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in exported
    assert not any(n.startswith("mtp.") for n in exported)
