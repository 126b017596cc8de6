"""Tier a: the Megatron <-> HF mapping table of the tiny Qwen3-MoE: its rows and the checkpoint keys
they name."""

from stapo_megatron.bridge import mappings_for, spec_from_hf_config
from stapo_megatron.bridge.tiny import tiny_config


def test_mapping_rows_and_checkpoint_keys():
    rows = {m.megatron: m for m in mappings_for(spec_from_hf_config(tiny_config("qwen3-moe")))}
    fc1 = rows["decoder.layers.*.mlp.experts.local_experts.#.linear_fc1.weight"]
    assert fc1.per_expert and fc1.transform == "gate_up"
    assert fc1.megatron_name(2, expert=1) == "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight"
    assert fc1.hf_names(2, 3) == ("model.layers.2.mlp.experts.3.gate_proj.weight",
                                  "model.layers.2.mlp.experts.3.up_proj.weight")
    assert fc1.checkpoint_key == "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    router = rows["decoder.layers.*.mlp.router.weight"]
    assert router.hf_names(0) == ("model.layers.0.mlp.gate.weight",) and not router.per_expert
    norm = rows["decoder.layers.*.pre_mlp_layernorm.weight"]
    assert norm.megatron_name(1, local_spec=True) == "decoder.layers.1.pre_mlp_layernorm.weight"
    assert not any("mlp.linear_fc1" in name for name in rows)
