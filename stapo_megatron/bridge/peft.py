"""Hugging Face PEFT's view of this project's LoRA adapters: the names PEFT gives them and the
split of Megatron's fused adapters into PEFT's per-projection ones.

An adapter on one of Megatron's fused linears (`stapo_megatron.mcore.lora`) has one A (r x in)
and one B (out x r); PEFT adapts transformers' separate projections. The split is the weight
converter's own data (`stapo_megatron.bridge.mapping`'s rows, `stapo_megatron.bridge.transforms`):

- ``linear_qkv`` -> ``q_proj``, ``k_proj``, ``v_proj``: B's rows split GQA-grouped (`split_qkv`),
  each projection keeping the shared A. Exact: q = W_q x + s B_q (A x) is the fused module's q.
- ``linear_fc1`` -> ``gate_proj``, ``up_proj``: B's rows [gate; up] (the full, unsharded layout)
  split in two (`split_gate_up`), A shared.
- ``linear_proj`` -> ``o_proj``, ``linear_fc2`` -> ``down_proj``: A and B as they are.

PEFT's scaling is ``lora_alpha / r`` (``use_rslora`` false), the trainer's ``alpha / rank``.
Used by the PEFT export (`stapo_megatron.conversion.peft_export`) and the adapter-only weight
sync into vLLM (`stapo_megatron.rollout.vllm_lora`), which loads the same folder layout.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from stapo_megatron.bridge.hf_config import QwenSpec
from stapo_megatron.bridge.mapping import ParamMapping, mappings_for
from stapo_megatron.bridge.transforms import split_gate_up, split_qkv

PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModel`` puts before the transformers module names in a saved adapter."""


def target_rows(spec: QwenSpec) -> Dict[str, ParamMapping]:
    """{Megatron target name (``linear_qkv``, ...): the mapping row of its weight} (dense layers)."""
    rows = {}
    for m in mappings_for(spec):
        leaf = m.megatron.rsplit(".", 2)
        if m.per_layer and not m.per_expert and leaf[-1] == "weight" and leaf[-2].startswith("linear_"):
            rows[leaf[-2]] = m
    return rows


def split_adapter(m: ParamMapping, spec: QwenSpec, a_full: torch.Tensor,
                  b_full: torch.Tensor) -> Tuple[Tuple[torch.Tensor, torch.Tensor], ...]:
    """One fused adapter's full (A, B) -> an (A, B) per HF projection of mapping row ``m``, in
    ``m.hf`` order (see the module docstring)."""
    if m.transform == "qkv":
        bs = split_qkv(b_full, spec.num_attention_heads, spec.num_query_groups, spec.kv_channels)
    elif m.transform == "gate_up":
        bs = split_gate_up(b_full, 1)  # the checkpoint's [gate; up] rows at any TP
    else:
        bs = (b_full,)
    return tuple((a_full, b) for b in bs)


def peft_tensors(adapters: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]],
                 spec: QwenSpec) -> Dict[str, torch.Tensor]:
    """PEFT's adapter tensors from the full adapters ``{(layer, target): (A, B)}``."""
    rows = target_rows(spec)
    out = {}
    for (layer, target), (a_full, b_full) in sorted(adapters.items()):
        if target not in rows:
            raise ValueError(f"lora target {target} has no transformers projection in this model ({sorted(rows)})")
        m = rows[target]
        for hf_name, (a, b) in zip(m.hf_names(layer), split_adapter(m, spec, a_full, b_full)):
            module = PEFT_PREFIX + hf_name[: -len(".weight")]
            out[f"{module}.lora_A.weight"] = a.clone()  # one copy per projection (safetensors shares none)
            out[f"{module}.lora_B.weight"] = b.contiguous()
    return out


def adapter_config(spec: QwenSpec, rank: int, alpha: float, dropout: float, targets, base_model: str) -> dict:
    """PEFT's ``adapter_config.json`` for adapters of ``rank`` on the HF projections of ``targets``."""
    rows = target_rows(spec)
    modules = sorted({name.split(".")[-2] for t in targets for name in rows[t].hf})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
            "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "base_model_name_or_path": base_model}
