"""A LoRA run's adapters as a Hugging Face PEFT adapter folder (`stapo-convert lora-to-peft`).

A LoRA checkpoint of the trainer (`stapo_megatron.mcore.checkpoint`) holds, per adapted linear,
A (r x in) and B (out x r) of Megatron's fused modules (`stapo_megatron.mcore.lora`), stacked over
the layers like every per-layer tensor of a dist checkpoint (``decoder.layers.<suffix>.lora.A``,
[L, r, in]). They are read whole (any TP they were saved at), split per transformers projection
and named as PEFT names them (`stapo_megatron.bridge.peft`). The folder: ``adapter_config.json``
(written here, so the export needs no peft) and
``adapter_model.safetensors`` with PEFT's keys ``base_model.model.<HF module>.lora_A.weight`` /
``lora_B.weight``. Mixture-of-experts expert adapters are not exported (transformers 5 stacks the
experts into one tensor, which PEFT's LoRA does not wrap per expert).
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import torch
import yaml

from stapo_megatron.bridge.hf_config import QwenSpec, load_hf_config, spec_from_hf_config
from stapo_megatron.bridge.mapping import LAYER_PREFIX
from stapo_megatron.bridge.peft import adapter_config, peft_tensors, target_rows
from stapo_megatron.conversion.dcp_io import CheckpointReader
from stapo_megatron.conversion.mcore_to_hf import find_hf_side_dir, resolve_checkpoint_dir

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def read_checkpoint_adapters(reader: CheckpointReader,
                             spec: QwenSpec) -> Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]]:
    """{(layer, target): (A, B)} of every dense adapter stored in a dist checkpoint (full
    tensors, whatever TP it was saved at). ValueError for expert adapters or no adapters."""
    stored = reader.tensors()
    if any(".experts." in k and ".lora." in k for k in stored):
        raise ValueError("the checkpoint holds expert adapters (lora.experts=True): PEFT export covers the "
                         "attention and dense MLP adapters only")
    adapters = {}
    for target, m in target_rows(spec).items():
        stem = m.checkpoint_key[: -len(".weight")]
        keys = {name: f"{stem}.lora.{name}" for name in ("A", "B")}
        if not all(k in stored for k in keys.values()):
            continue
        full = reader.read({k: ((0,) * len(stored[k].size), tuple(stored[k].size)) for k in keys.values()})
        a_LRI, b_LOR = full[keys["A"]], full[keys["B"]]
        for layer in range(spec.num_layers):
            adapters[(layer, target)] = (a_LRI[layer], b_LOR[layer])
    if not adapters:
        raise ValueError(f"{reader.path} holds no LoRA adapters (keys {LAYER_PREFIX}<linear>.lora.A / .lora.B): "
                         f"not a checkpoint of a run with the lora section")
    return adapters


def checkpoint_lora_section(ckpt_dir: str) -> dict:
    """The ``lora`` section of the run configuration a trainer checkpoint carries (config.yaml)."""
    path = os.path.join(ckpt_dir, "config.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing (trainer checkpoints carry their run's config.yaml): pass --alpha")
    with open(path, encoding="utf-8") as f:
        lora = ((yaml.safe_load(f) or {}).get("trainer") or {}).get("lora")
    if not lora:
        raise ValueError(f"{path}: the run has no lora section (lora=None): not a LoRA run")
    return lora


def export_peft(ckpt: str, out: str, alpha: Optional[float] = None, hf_config_dir: Optional[str] = None,
                overwrite: bool = False) -> list:
    """Write the PEFT adapter folder ``out`` from a LoRA run's checkpoint (a run folder, its
    ``checkpoints`` or one step); ``alpha`` defaults to the run's ``lora.alpha``. Returns the
    files written."""
    from safetensors.torch import save_file

    ckpt_dir = resolve_checkpoint_dir(ckpt)
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ValueError(f"output folder {out} is not empty (pass --overwrite to replace it)")
    side = find_hf_side_dir(ckpt, ckpt_dir, hf_config_dir)
    spec = spec_from_hf_config(load_hf_config(side))
    reader = CheckpointReader(ckpt_dir, probe=None)
    adapters = read_checkpoint_adapters(reader, spec)
    section = checkpoint_lora_section(ckpt_dir) if alpha is None else {"alpha": alpha}
    ranks = {a.shape[0] for a, _ in adapters.values()}
    assert len(ranks) == 1, ranks  # one LoraConfig per run
    config = adapter_config(spec, ranks.pop(), float(section["alpha"]), float(section.get("dropout", 0.0)),
                            sorted({t for _, t in adapters}), os.path.abspath(side))
    os.makedirs(out, exist_ok=True)
    save_file(peft_tensors(adapters, spec), os.path.join(out, ADAPTER_FILES[1]), metadata={"format": "pt"})
    with open(os.path.join(out, ADAPTER_FILES[0]), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return [os.path.join(out, name) for name in ADAPTER_FILES]
