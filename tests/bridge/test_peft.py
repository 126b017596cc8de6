"""Tier a: PEFT's split of the fused adapters (`stapo_megatron.bridge.peft`): per projection,
B_proj A is exactly the projection's rows of the fused B A, under PEFT's names."""

import torch

from stapo_megatron.bridge.hf_config import spec_from_hf_config
from stapo_megatron.bridge.peft import PEFT_PREFIX, adapter_config, peft_tensors, target_rows
from stapo_megatron.bridge.tiny import tiny_config
from stapo_megatron.bridge.transforms import split_gate_up, split_qkv


def test_the_split_adapters_are_the_fused_update_per_projection():
    spec = spec_from_hf_config(tiny_config("qwen3"))
    gen = torch.Generator().manual_seed(0)
    rows = target_rows(spec)
    assert sorted(rows) == ["linear_fc1", "linear_fc2", "linear_proj", "linear_qkv"]
    out_dims = {"linear_qkv": spec.q_size + 2 * spec.kv_size, "linear_proj": spec.hidden_size,
                "linear_fc1": 2 * spec.ffn_hidden_size, "linear_fc2": spec.hidden_size}
    in_dims = {"linear_qkv": spec.hidden_size, "linear_proj": spec.q_size, "linear_fc1": spec.hidden_size,
               "linear_fc2": spec.ffn_hidden_size}
    fused = {(1, t): (torch.randn(3, in_dims[t], generator=gen), torch.randn(out_dims[t], 3, generator=gen))
             for t in rows}
    tensors = peft_tensors(fused, spec)
    assert len(tensors) == 2 * 7

    def delta(module):
        key = f"{PEFT_PREFIX}model.layers.1.{module}"
        return tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]

    a, b = fused[(1, "linear_qkv")]
    for module, rows_of in zip(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                               split_qkv(b @ a, spec.num_attention_heads, spec.num_query_groups, spec.kv_channels)):
        torch.testing.assert_close(delta(module), rows_of, rtol=0, atol=1e-5)
    a, b = fused[(1, "linear_fc1")]
    for module, rows_of in zip(("mlp.gate_proj", "mlp.up_proj"), split_gate_up(b @ a)):
        torch.testing.assert_close(delta(module), rows_of, rtol=0, atol=1e-5)
    a, b = fused[(1, "linear_proj")]
    assert torch.equal(delta("self_attn.o_proj"), b @ a)
    config = adapter_config(spec, 3, 6.0, 0.0, ["linear_qkv", "linear_fc2"], "base")
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj", "v_proj"] and config["r"] == 3
