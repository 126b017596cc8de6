"""Tier a: Qwen3.5 configs -> QwenSpec (layer pattern, delta-net fields, partial RoPE, output gate),
their parameter counts against transformers, the mapping rows of the hybrid layers, and what is
refused (a layer type the converter does not map, a vision-language checkpoint, layouts)."""

import copy
import dataclasses

import pytest

from stapo_megatron.bridge import check_parallel_sizes, hf_shapes, mappings_for, spec_from_hf_config
from stapo_megatron.bridge.hf_config import num_params
from stapo_megatron.bridge.hybrid_config import delta_net_dims
from stapo_megatron.bridge.mapping import checkpoint_parts
from stapo_megatron.bridge.tiny import build_hf_model, tiny_config, transformers_config
from tests.helpers.qwen_configs import QWEN3_14B, QWEN35_27B_TEXT, QWEN35_27B_VL


def test_qwen35_27b_text_fields():
    s = spec_from_hf_config(QWEN35_27B_TEXT)
    # transformers' default pattern from full_attention_interval 4: layers 3, 7, ... full attention
    assert s.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert s.layers_of_type("full_attention") == tuple(range(3, 64, 4)) and s.is_hybrid
    assert (s.rotary_percent, s.attention_output_gate, s.zero_centered_norm, s.mtp_num_layers) == (0.25, True, True, 1)
    assert (s.kv_channels, s.rotary_base, s.vocab_size) == (256, 1e7, 248320)
    assert delta_net_dims(s) == dict(qk=16 * 128, v=48 * 128, heads=48, conv=2 * 16 * 128 + 48 * 128)


@pytest.mark.parametrize("variant", ["qwen3.5", "qwen3.5-tied", "qwen3.5-moe"])
def test_parameter_count_and_shapes_equal_transformers(variant):
    """num_params and hf_shapes of the spec are those of transformers' Qwen3_5ForCausalLM (and
    Qwen3_5MoeForCausalLM, whose experts save as the released per-expert tensors)."""
    import tempfile

    from stapo_megatron.conversion.safetensors_io import index_checkpoint, read_rows

    spec = spec_from_hf_config(tiny_config(variant))
    model = build_hf_model(transformers_config(tiny_config(variant)), seed=0)
    with tempfile.TemporaryDirectory() as saved:  # the checkpoint's names (experts unfused)
        model.save_pretrained(saved)
        state = {n: read_rows(info) for n, info in index_checkpoint(saved).items()}
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    assert {n: tuple(t.shape) for n, t in state.items()} == hf_shapes(spec)
    assert num_params(spec) == sum(t.numel() for t in state.values())


def test_mapping_rows_cover_each_layer_type_once():
    spec = spec_from_hf_config(tiny_config("qwen3.5"))
    rows = mappings_for(spec)
    mapped = {n for m in rows for index in m.indices(spec) for n in m.hf_names(*index)}
    assert mapped == set(hf_shapes(spec))  # every HF tensor, no name twice
    assert sum(len(m.indices(spec)) * len(m.hf) for m in rows) == len(mapped)
    in_proj = next(m for m in rows if m.transform == "delta_in_proj")
    assert in_proj.indices(spec) == [(0,), (1,), (2,)] and not in_proj.stacked
    assert in_proj.checkpoint_key_at((2,)) == "decoder.layers.2.self_attention.in_proj.weight"
    d = delta_net_dims(spec)
    # megatron-core's GatedDeltaNet.sharded_state_dict: q, k, v, z, beta, alpha
    assert checkpoint_parts(in_proj, spec) == [("query", 0, 0, d["qk"]), ("key", 0, d["qk"], d["qk"]),
                                               ("value", 0, 2 * d["qk"], d["v"]), ("z", 1, 0, d["v"]),
                                               ("beta", 2, 0, d["heads"]), ("alpha", 3, 0, d["heads"])]


@pytest.mark.parametrize("change, needle", [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "layer_types entry 'sliding_attention' (layer 1) is not mapped"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types must list one entry per layer"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    ({"linear_key_head_dim": 0}, "'linear_key_head_dim' must be a positive integer"),
    ({"rope_parameters": {"rope_theta": 1e7, "rope_type": "default", "partial_rotary_factor": 0.3}},
     "partial_rotary_factor 0.3"),
    ({"rope_parameters": {"rope_theta": 1e7, "rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
])
def test_unmapped_qwen35_options_are_refused_naming_the_field(change, needle):
    with pytest.raises(ValueError) as e:
        spec_from_hf_config({**tiny_config("qwen3.5"), **change})
    assert needle in str(e.value)


def test_vision_language_checkpoint_is_refused_by_name():
    with pytest.raises(ValueError, match="'Qwen3_5ForConditionalGeneration' is a vision-language checkpoint") as e:
        spec_from_hf_config(QWEN35_27B_VL)
    assert "vision tower" in str(e.value)
    no_arch = {k: v for k, v in copy.deepcopy(QWEN35_27B_VL).items() if k != "architectures"}
    with pytest.raises(ValueError, match="vision-language"):  # found from model_type 'qwen3_5' too
        spec_from_hf_config(no_arch)


def test_partial_rope_is_refused_outside_qwen35():
    cfg = {**QWEN3_14B, "rope_parameters": {**QWEN3_14B["rope_parameters"], "partial_rotary_factor": 0.5}}
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5"):
        spec_from_hf_config(cfg)


def test_tp_must_divide_the_delta_net_heads():
    spec = spec_from_hf_config(tiny_config("qwen3.5"))  # 2 key heads, 4 value heads
    check_parallel_sizes(spec, 2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size 4 does not divide linear_num_key_heads 2"):
        check_parallel_sizes(dataclasses.replace(spec, num_attention_heads=8, num_query_groups=4), 4)


def test_qwen35_moe_fields():
    cfg = tiny_config("qwen3.5-moe")
    s = spec_from_hf_config(cfg)
    assert (s.num_moe_experts, s.moe_router_topk, s.moe_ffn_hidden_size, s.moe_shared_expert_intermediate_size) == (
        4, 2, 32, 32)
    assert s.norm_topk_prob and s.is_hybrid  # transformers' Qwen3.5-MoE router always renormalises
    rows = {m.megatron for m in mappings_for(s)}
    assert "decoder.layers.*.mlp.shared_experts.gate_weight" in rows
    with pytest.raises(ValueError, match="'shared_expert_intermediate_size' must be a positive integer"):
        spec_from_hf_config({**cfg, "shared_expert_intermediate_size": None})
    with pytest.raises(ValueError, match="only every layer a MoE layer"):
        spec_from_hf_config({**cfg, "mlp_only_layers": [0]})


def test_delta_net_layouts_refuse_cp_by_release_and_packed_sequence_parallelism_naming_the_fields():
    """One check for the bridge (the block spec) and the layout validator (which also refuses
    sequence parallelism with packed micro-batches): context parallelism before megatron-core
    0.19, naming the installed version; from 0.19 a CP size that does not divide a TP rank's
    delta-net key or value heads (the tiny has 2 key and 4 value heads)."""
    from megatron.core import __version__

    from stapo_megatron.bridge.hybrid_config import delta_net_layout_problems
    from stapo_megatron.mcore.mcore_versions import delta_net_has_context_parallel

    hybrid, dense = spec_from_hf_config(tiny_config("qwen3.5")), spec_from_hf_config(tiny_config("qwen3"))
    assert delta_net_layout_problems(hybrid, 1, sequence_parallel=True, packed=False) == []
    assert delta_net_layout_problems(hybrid, 1, sequence_parallel=False, packed=True) == []
    assert delta_net_layout_problems(dense, 4, sequence_parallel=True, packed=True) == []
    (sp,) = delta_net_layout_problems(hybrid, 1, sequence_parallel=True, packed=True)
    assert sp.startswith("model.sequence_parallel=True with packed micro-batches is not supported")
    if not delta_net_has_context_parallel():
        cp, sp2 = delta_net_layout_problems(hybrid, 2, sequence_parallel=True, packed=True)
        assert cp.startswith(f"model.context_parallel_size 2 is not supported for Qwen3_5ForCausalLM on "
                             f"megatron-core {__version__}") and "3 linear" in cp and "from megatron-core 0.19" in cp
        assert sp2 == sp
        return
    assert delta_net_layout_problems(hybrid, 2, packed=True) == []
    (key,) = delta_net_layout_problems(hybrid, 4, packed=True)
    assert key.startswith("linear_num_key_heads 2 per tensor_model_parallel_size 1 rank (2) is not divisible by "
                          "model.context_parallel_size 4")
    (key,) = delta_net_layout_problems(hybrid, 2, packed=True, tensor_model_parallel_size=2)
    assert key.startswith("linear_num_key_heads 2 per tensor_model_parallel_size 2 rank (1) is not divisible")
    assert len(delta_net_layout_problems(hybrid, 8, packed=True)) == 2  # key and value heads
