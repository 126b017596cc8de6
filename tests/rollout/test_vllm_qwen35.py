"""Tier a: `rollout.vllm_qwen35`: the CPU Qwen3.5 engine's refusals, and vLLM's real Qwen3.5 class
registered in this process without torchvision (the engine itself: tests/integration/test_qwen35_vllm.py)."""

import json
import sys

import pytest
import torch

from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.rollout import vllm_qwen35
from stapo_megatron.rollout.vllm_qwen35 import (
    PIL_PROCESSOR,
    QWEN35_ARCHITECTURES,
    TORCHVISION_PROCESSOR,
    alias_torchvision_processor,
    check_cpu_qwen35_engine,
    prepare_qwen35_engine,
    vllm_imports_from,
)

pytest.importorskip("vllm")

CPU_READY = tiny_config("qwen3.5-h128")


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16"])
def test_a_bf16_engine_with_128_wide_delta_heads_passes(dtype):
    check_cpu_qwen35_engine(CPU_READY, dtype)
    check_cpu_qwen35_engine({**CPU_READY, "linear_key_head_dim": 64, "linear_value_head_dim": 64}, dtype)


def test_auto_takes_the_checkpoints_dtype():
    check_cpu_qwen35_engine({**CPU_READY, "dtype": "bfloat16"}, "auto")
    check_cpu_qwen35_engine({**CPU_READY, "torch_dtype": "bfloat16"}, "auto")  # transformers 4's key
    with pytest.raises(ValueError, match=r"RolloutConfig.dtype 'auto' \(resolves to 'float32'\).*BF16"):
        check_cpu_qwen35_engine({**CPU_READY, "dtype": "float32"}, "auto")


def test_an_fp32_engine_is_refused_by_field_and_reason():
    with pytest.raises(ValueError, match=r"RolloutConfig.dtype 'float32'.*bfloat16 only"):
        check_cpu_qwen35_engine(CPU_READY, "float32")


@pytest.mark.parametrize("key, value", [(16, 16), (32, 32), (96, 96), (256, 256), (64, 128)])
def test_delta_net_head_dims_the_cpu_kernel_refuses_are_refused_by_field(key, value):
    with pytest.raises(ValueError, match=f"linear_key_head_dim {key} and linear_value_head_dim {value}"):
        check_cpu_qwen35_engine({**CPU_READY, "linear_key_head_dim": key, "linear_value_head_dim": value},
                                "bfloat16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's limits")
def test_the_engine_refuses_before_vllm_starts(tmp_path):
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.vllm_engine import VLLMEngine

    (tmp_path / "config.json").write_text(json.dumps(CPU_READY))  # no weights: vLLM would fail on them
    with pytest.raises(ValueError, match="RolloutConfig.dtype 'float32'"):
        VLLMEngine(str(tmp_path), RolloutConfig(dtype="float32"))


def test_only_qwen35_engines_are_checked_and_only_on_the_cpu():
    prepare_qwen35_engine(tiny_config("qwen3"), "float32", on_gpu=False)  # a dense model: untouched
    with pytest.raises(ValueError, match="linear_key_head_dim 16"):
        prepare_qwen35_engine(tiny_config("qwen3.5"), "bfloat16", on_gpu=False)
    assert vllm_qwen35.is_qwen35(tiny_config("qwen3.5-moe"))


def test_the_pil_image_processor_defines_every_name_vllm_imports_from_the_torchvision_one():
    import importlib

    names = vllm_imports_from(TORCHVISION_PROCESSOR)
    assert "smart_resize" in names  # qwen3_vl.py and qwen2_vl.py (vLLM 0.32)
    twin = importlib.import_module(PIL_PROCESSOR)
    assert all(hasattr(twin, name) for name in names), sorted(names)


def test_a_name_the_pil_module_lacks_is_named(tmp_path):
    (tmp_path / "model.py").write_text(f"from {TORCHVISION_PROCESSOR} import smart_resize, Qwen2VLImageProcessorFast\n")
    with pytest.raises(ImportError, match=r"\['Qwen2VLImageProcessorFast'\]"):
        alias_torchvision_processor(tmp_path)


@pytest.mark.skipif(vllm_qwen35.torchvision_importable(), reason="with torchvision vLLM imports Qwen3.5 itself")
@pytest.mark.parametrize("architecture", QWEN35_ARCHITECTURES)
def test_vllms_own_class_is_registered_and_inspected_in_this_process(architecture):
    from vllm import ModelRegistry

    cls = vllm_qwen35.register_without_torchvision(architecture)
    assert sys.modules[TORCHVISION_PROCESSOR].__name__ == PIL_PROCESSOR
    assert cls is getattr(sys.modules["vllm.model_executor.models.qwen3_5"], architecture)
    info = ModelRegistry.models[architecture].inspect_model_cls()  # in-process: no "failed to be inspected"
    assert info.is_hybrid and info.has_inner_state
    assert vllm_qwen35.register_without_torchvision(architecture) is cls  # idempotent
    # the text model holds no MTP weights: vLLM's loader drops the checkpoint's mtp.* tensors
    assert cls.hf_to_vllm_mapper.orig_to_new_prefix["mtp."] is None
