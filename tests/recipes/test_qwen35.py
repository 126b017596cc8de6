"""Tier a: the Qwen3.5 recipes (stapo_megatron/recipes/qwen35.py): their architectures as the
converter reads the released text configs, the parameter counts against the model cards, the
paper's STAPO settings, layouts without context parallelism, and the refusals naming the field
(context parallelism: before megatron-core 0.19, or not dividing the delta-net heads)."""

import dataclasses
import re

import pytest

from stapo_megatron.bridge.hf_config import num_active_params, num_params, spec_from_hf_config
from stapo_megatron.launch.entry import build_config
from stapo_megatron.recipes import delta_net, memory, paper, qwen35
from tests.helpers.qwen_configs import QWEN35_27B_TEXT

SIZES = ("qwen35_27b", "qwen35_35b_a3b")


def test_the_27b_is_the_released_text_config():
    """The recipe's spec is the one the conversion tests read from the 27B's text config."""
    assert qwen35.QWEN35_ARCHITECTURES["qwen35_27b"] == spec_from_hf_config(QWEN35_27B_TEXT)


@pytest.mark.parametrize("size, total, active, linear, full", [
    ("qwen35_27b", 26.9, 26.9, 48, 16), ("qwen35_35b_a3b", 34.7, 3.5, 30, 10)])
def test_parameter_counts_and_layers(size, total, active, linear, full):
    """The cards: 27B; 35B with 3B active (the text model, vision tower aside; 3.45B by this count)."""
    spec = paper.ARCHITECTURES[size]
    assert round(num_params(spec) / 1e9, 1) == total and round(num_active_params(spec) / 1e9, 1) == active
    assert (delta_net.num_linear_layers(spec), delta_net.num_attention_layers(spec)) == (linear, full)
    assert (spec.vocab_size, spec.kv_channels, spec.rotary_percent, spec.mtp_num_layers) == (248320, 256, 0.25, 1)


@pytest.mark.parametrize("size", SIZES)
def test_the_paper_settings_and_no_context_parallelism(size):
    cfg, base = paper.paper_recipe(size), paper.paper_recipe("qwen3_30b_a3b")
    assert cfg.loss == base.loss and cfg.optim == base.optim and cfg.rollout.max_response_len == 15360
    assert (cfg.steps, cfg.prompts_per_step, cfg.minibatch_prompts, cfg.rollout.group_size) == (3000, 256, 64, 8)
    assert cfg.model.context_parallel_size == 1 and cfg.packing == qwen35.QWEN35_PACKING[size]
    # packed delta-net layers take whole sequences: sequence parallelism only with padded micro-batches
    assert cfg.model.sequence_parallel == (cfg.packing == "padded")
    assert getattr(paper, size)() == cfg
    layout = paper.layout_for(size, cfg)
    assert memory.memory_estimate(paper.ARCHITECTURES[size], layout).total < memory.GPU_MEMORY_BYTES
    assert paper.layout_problems(paper.ARCHITECTURES[size], layout, cfg) == []


def test_the_kv_cache_counts_full_attention_layers_and_states_per_sequence():
    """27B at vLLM TP=4: K and V of 16 layers (2 x 4 heads x 256 x 2 B / 4 = 16 KiB a token) and
    per 16k-token sequence its 48 layers' states (48 heads x 128 x 128 fp32, and the conv's last 3
    inputs of 10240 channels in bf16, / 4)."""
    spec, layout = paper.ARCHITECTURES["qwen35_27b"], paper.LAYOUTS["qwen35_27b"]
    state = 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2) / 4
    assert delta_net.state_bytes_per_sequence(spec, 4) == state
    est = memory.memory_estimate(spec, layout)
    free = est.vllm - 2 * num_params(spec) / 4 - memory.VLLM_RUNTIME_BYTES
    assert est.vllm_kv_tokens == int(free / (16384 * 16384 + state) * 16384)


@pytest.mark.parametrize("size, overrides", [
    ("qwen35_35b_a3b", dict(model={"context_parallel_size": 2}, max_tokens_per_microbatch=8192)),
    ("qwen35_27b", dict(model={"context_parallel_size": 2, "pipeline_model_parallel_size": 1},
                        packing="budget", max_tokens_per_microbatch=8192)),
])
def test_context_parallelism_is_refused_before_megatron_core_0_19_naming_the_field(size, overrides):
    """Before megatron-core 0.19 the dry run refuses CP naming the field and the installed release;
    from 0.19 it refuses only a CP size that does not divide a TP rank's delta-net heads."""
    from megatron.core import __version__

    from stapo_megatron.mcore.mcore_versions import delta_net_has_context_parallel

    if not delta_net_has_context_parallel():
        with pytest.raises(ValueError, match=rf"model.context_parallel_size 2 is not supported for Qwen3_5\w+ on "
                                             rf"megatron-core {re.escape(__version__)}"):
            build_config(size, check_paths=False, **overrides)
        return
    try:
        build_config(size, check_paths=False, **overrides)
    except ValueError as refused:  # the 27B at CP = 2 is refused for other reasons (memory, sequence parallelism)
        assert "context_parallel_size 2 is not supported" not in str(refused)
    tp = paper.LAYOUTS[size].tensor_model_parallel_size
    cp = 16  # more CP ranks than the 16 key heads leave per TP rank (8 and 4)
    with pytest.raises(ValueError, match=rf"linear_num_key_heads 16 per tensor_model_parallel_size {tp} rank "
                                         rf"\({16 // tp}\) is not divisible by model.context_parallel_size {cp}"):
        build_config(size, check_paths=False,
                     **{**overrides, "model": {**overrides["model"], "context_parallel_size": cp}})


def test_sequence_parallelism_with_packing_is_refused_naming_the_fields():
    with pytest.raises(ValueError, match=r"model.sequence_parallel=True with packed micro-batches"):
        build_config("qwen35_35b_a3b", check_paths=False, model={"sequence_parallel": True})


def test_tp_beyond_the_kv_heads_is_refused():
    with pytest.raises(ValueError, match="num_query_groups 2 is not divisible by tensor_model_parallel_size 4"):
        build_config("qwen35_35b_a3b", check_paths=False, model={"tensor_model_parallel_size": 4},
                     rollout={"tensor_parallel_size": 4})


def test_the_layouts_are_what_the_docs_say():
    l27, l35 = paper.LAYOUTS["qwen35_27b"], paper.LAYOUTS["qwen35_35b_a3b"]
    assert (l27.num_nodes, l27.tensor_model_parallel_size, l27.pipeline_model_parallel_size,
            l27.data_parallel_size, l27.vllm_tensor_parallel_size) == (8, 4, 2, 8, 4)
    assert (l35.num_nodes, l35.tensor_model_parallel_size, l35.expert_model_parallel_size,
            l35.expert_tensor_size, l35.data_parallel_size, l35.vllm_tensor_parallel_size) == (8, 2, 64, 1, 32, 2)
    # EP=32 would not fit on the same 8 nodes
    est = memory.memory_estimate(paper.ARCHITECTURES["qwen35_35b_a3b"], dataclasses.replace(
        l35, model=dataclasses.replace(l35.model, expert_model_parallel_size=32)))
    assert est.total > memory.GPU_MEMORY_BYTES
