"""`LoraConfig`: defaults, scaling, and the refusals that name the field."""

import pytest

from stapo_megatron.mcore.lora_config import LORA_TARGETS, LoraConfig


def test_defaults_target_every_dense_linear_and_scale_alpha_over_rank():
    config = LoraConfig()
    assert config.target_modules == list(LORA_TARGETS) and not config.experts
    assert config.scaling == 2.0
    assert LoraConfig(rank=8, alpha=4).scaling == 0.5
    assert LoraConfig(target_modules=("linear_fc1",)).target_modules == ["linear_fc1"]


@pytest.mark.parametrize("fields, message", [
    (dict(rank=0), r"lora.rank must be a positive integer, got 0"),
    (dict(rank=-4), r"lora.rank must be a positive integer, got -4"),
    (dict(rank=2.5), r"lora.rank must be a positive integer, got 2.5"),
    (dict(rank=True), r"lora.rank must be a positive integer, got True"),
    (dict(alpha=0.0), r"lora.alpha must be finite and > 0, got 0.0"),
    (dict(alpha=float("inf")), r"lora.alpha must be finite and > 0, got inf"),
    (dict(dropout=1.0), r"lora.dropout must be in \[0, 1\), got 1.0"),
    (dict(dropout=-0.1), r"lora.dropout must be in \[0, 1\), got -0.1"),
    (dict(target_modules=["linear_qkv", "q_proj"]), r"lora.target_modules: \['q_proj'\] are not adaptable linears"),
    (dict(target_modules="linear_qkv"), r"lora.target_modules must be a list of module names"),
    (dict(target_modules=[]), r"lora.target_modules is empty"),
    (dict(target_modules=["linear_fc1", "linear_fc1"]), r"lora.target_modules names a module twice"),
    (dict(experts=True, target_modules=["linear_qkv"]), r"lora.experts=True but lora.target_modules"),
])
def test_bad_values_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**fields)


def test_the_config_imports_no_megatron():
    import subprocess
    import sys

    code = ("import sys, stapo_megatron.mcore.lora_config; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_rank_problems_name_each_linear_narrower_than_the_rank():
    from stapo_megatron.mcore.lora_config import rank_problems

    shapes = {"linear_qkv": (64, 256), "linear_proj": (128, 64), "linear_fc2": (32, 64)}  # no linear_fc1
    assert rank_problems(LoraConfig(rank=32), shapes) == []
    assert rank_problems(LoraConfig(rank=33), shapes, " in M") == [
        "lora.rank 33 is larger than linear_fc2's smaller dimension 32 (in 32, out 64) in M"]
    assert len(rank_problems(LoraConfig(rank=65), shapes)) == 3
