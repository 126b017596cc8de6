"""Tier a: a LoRA run's checkpoint exported as a PEFT adapter (`stapo-convert lora-to-peft`) and
loaded with ``peft`` onto the transformers model gives the Megatron model's logits (adapters on),
within the converter's parity tolerance; the fused QKV and gate/up adapters are split per
projection under PEFT's names."""

import json
import os

import pytest
import torch

from stapo_megatron.bridge.tiny import save_tiny_hf_model
from stapo_megatron.conversion.cli import main
from stapo_megatron.conversion.verify import FP32_LOGIT_TOL
from stapo_megatron.mcore.lora_config import LoraConfig
from tests.helpers.lora_models import forward, full_adapter_weights

LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.05)
ADAPTER_EFFECT = 100 * FP32_LOGIT_TOL
"""The hand-set adapters move the logits by more than this: the parity is not
the base model's agreeing with itself."""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("peft") / "hf")
    save_tiny_hf_model(path, "qwen3", dtype=torch.float32, seed=0)
    return path


def _lora_run(parallel, hf_dir, root, lora=LORA):
    """A checkpoint of a LoRA run on the tiny Qwen3 (its HF weights, trained-size adapters, the
    run's config.yaml); returns (run folder, Megatron logits [B, S, V] of ``tokens_BS``)."""
    from stapo_megatron.bridge.hf_config import load_hf_config
    from stapo_megatron.bridge.model import build_gpt_model, load_checkpoint
    from stapo_megatron.config import TrainerConfig
    from stapo_megatron.config.yaml_io import write_config
    from stapo_megatron.mcore import checkpoint as ckpt
    from stapo_megatron.mcore.config import OptimConfig
    from stapo_megatron.mcore.lora import apply_lora
    from stapo_megatron.mcore.step import wrap_model_and_optimizer

    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(root / "base")]) == 0
    model = build_gpt_model(load_hf_config(hf_dir), params_dtype=torch.float32, calculate_per_token_loss=True)
    load_checkpoint(model, str(root / "base"))
    adapters = apply_lora(model, lora)
    for name, adapter in adapters.items():
        adapter.load_full_(*full_adapter_weights(name, adapter.full_shapes, scale_a=0.15, scale_b=0.15))
    ddp, optimizer = wrap_model_and_optimizer(model, OptimConfig())
    run = str(root / "run")
    ckpt.save_checkpoint(run, 1, ddp, optimizer, {},
                         lambda d: write_config(os.path.join(d, "config.yaml"), TrainerConfig(lora=lora)))
    model.eval()
    with torch.no_grad():
        logits = forward(model, _tokens(model.qwen_spec.vocab_size))[..., : model.qwen_spec.vocab_size]
    return run, logits


def _tokens(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))


def test_the_peft_adapter_gives_the_megatron_logits(parallel, hf_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run, want = _lora_run(parallel, hf_dir, tmp_path)
    out = str(tmp_path / "adapter")
    assert main(["lora-to-peft", "--ckpt", run, "--out", out, "--hf-config", hf_dir]) == 0
    config = json.load(open(os.path.join(out, "adapter_config.json")))
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.05)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tensors = load_file(os.path.join(out, "adapter_model.safetensors"))
    layers = json.load(open(os.path.join(hf_dir, "config.json")))["num_hidden_layers"]
    assert len(tensors) == 2 * 7 * layers, "A and B of 7 projections in every layer"
    q, k = "base_model.model.model.layers.1.self_attn.q_proj", "base_model.model.model.layers.1.self_attn.k_proj"
    assert torch.equal(tensors[f"{q}.lora_A.weight"], tensors[f"{k}.lora_A.weight"]), "the fused QKV's one A"
    assert tensors[f"{q}.lora_B.weight"].shape[1] == 4 and tensors[f"{q}.lora_A.weight"].shape[0] == 4

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    tokens = _tokens(want.shape[-1])
    with torch.no_grad():
        plain = base(input_ids=tokens).logits
        got = PeftModel.from_pretrained(base, out).eval()(input_ids=tokens).logits
    scale = max(1.0, float(want.abs().max()))
    diff = float((got - want).abs().max())
    print(f"PEFT vs Megatron: max |dlogit| {diff:.2e} (allowed {FP32_LOGIT_TOL * scale:.2e})")
    assert diff <= FP32_LOGIT_TOL * scale  # the converter's fp32 parity tolerance (verify.py); measured 3.9e-6
    assert float((plain - want).abs().max()) > ADAPTER_EFFECT * scale


def test_the_export_refuses_what_is_no_lora_run(parallel, hf_dir, tmp_path, capsys):
    assert main(["hf-to-mcore", "--hf-dir", hf_dir, "--out", str(tmp_path / "full")]) == 0
    assert main(["lora-to-peft", "--ckpt", str(tmp_path / "full"), "--out", str(tmp_path / "a"),
                 "--hf-config", hf_dir]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err
    run, _ = _lora_run(parallel, hf_dir, tmp_path, LoraConfig(rank=2, target_modules=["linear_proj"]))
    os.makedirs(tmp_path / "busy")
    open(tmp_path / "busy" / "x", "w").close()
    assert main(["lora-to-peft", "--ckpt", run, "--out", str(tmp_path / "busy"), "--hf-config", hf_dir]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main(["lora-to-peft", "--ckpt", run, "--out", str(tmp_path / "proj"), "--hf-config", hf_dir]) == 0
    assert json.load(open(tmp_path / "proj" / "adapter_config.json"))["target_modules"] == ["o_proj"]
