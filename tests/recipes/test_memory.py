"""Tier a: the memory estimate of each paper layout, by hand: parameter counts against the model
cards, activations with and without recomputation and CP, MoE experts per GPU, and the per-rank
token budget."""

import dataclasses

import pytest

from stapo_megatron.batch import alignment
from stapo_megatron.bridge import hf_config
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.recipes import memory, paper


def _full_recompute(layout, **changes):
    return layout.replace(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, **changes)


@pytest.mark.parametrize("size, total, non_embedding", [
    ("qwen3_1p7b", 1.7, 1.4), ("qwen3_8b", 8.2, 6.9), ("qwen3_14b", 14.8, 13.2), ("qwen3_30b_a3b", 30.5, 29.9)])
def test_parameter_counts_match_the_model_cards(size, total, non_embedding):
    spec = paper.ARCHITECTURES[size]
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    # the model cards give one decimal (8B: 6.95B non-embedding)
    assert round(hf_config.num_params(spec) / 1e9, 1) == total
    assert round((hf_config.num_params(spec) - embeddings) / 1e9, 1) == non_embedding


def test_30b_a3b_active_parameters_match_the_model_card():
    """Qwen3-30B-A3B's card: 30.5B in total, 3.3B activated (8 of 128 experts per token)."""
    spec = paper.ARCHITECTURES["qwen3_30b_a3b"]
    assert (spec.num_layers, spec.hidden_size, spec.num_moe_experts, spec.moe_router_topk,
            spec.moe_ffn_hidden_size, spec.num_query_groups) == (48, 2048, 128, 8, 768, 4)
    expert = 3 * 2048 * 768
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048
    layer = attention + 2048 * 128 + 2 * 2048 + 2 * 128  # + router, two RMSNorms, q/k norms
    embeddings = 2 * 151936 * 2048  # untied
    assert hf_config.num_params(spec) == 48 * (layer + 128 * expert) + embeddings + 2048
    assert hf_config.num_active_params(spec) == 48 * (layer + 8 * expert) + embeddings + 2048
    assert round(hf_config.num_active_params(spec) / 1e9, 1) == 3.4  # 3.35B: the card rounds down to 3.3B
    assert 3.3e9 < hf_config.num_active_params(spec) < 3.4e9
    dense = paper.ARCHITECTURES["qwen3_8b"]
    assert hf_config.num_active_params(dense) == hf_config.num_params(dense)


def test_memory_estimate_of_14b_by_hand():
    """Full recomputation at TP=4, CP=1, DP=16 (the 14B layout before CP), term by term."""
    spec = paper.ARCHITECTURES["qwen3_14b"]
    layout = _full_recompute(paper.LAYOUTS["qwen3_14b"], context_parallel_size=1, vllm_gpu_memory_utilization=0.4)
    est = memory.memory_estimate(spec, layout)
    layer = 5120 * (5120 + 2 * 1024) + 5120 * 5120 + 3 * 5120 * 17408 + 2 * 5120 + 2 * 128
    vocab = 152064  # 151936 padded to a multiple of 128 x TP
    params = 40 * layer // 4 + 2 * vocab // 4 * 5120 + 5120  # untied: embedding + output layer
    assert est.weights == 2 * params and est.grads == 4 * params
    assert est.optimizer == pytest.approx(12 * params / 16)
    tokens = 16384
    assert est.logits == pytest.approx(tokens * vocab / 4 * 4)  # bf16 logits + bf16 gradient
    kept = 2 * 5120 / 4 * tokens * 40
    one_layer = 2 * (4 * 5120 / 4 + (2 * 5120 + 2 * 1024 + 3 * 17408) / 4) * tokens
    assert est.activations == pytest.approx(kept + 2 * one_layer)
    card = 80 * 2**30  # vLLM's fraction is of the card's total memory (85.9e9 bytes), not of 80e9
    assert est.vllm == 0.4 * card
    assert est.vllm_kv_tokens == int((0.4 * card - 2 * hf_config.num_params(spec) / 4 - 2e9) / (2 * 40 * 1024 * 2 / 4))
    assert est.reference == 0


def test_memory_estimate_of_14b_with_cp_by_hand():
    """The 14B recipe: TP=4, CP=4, DP=4, no recomputation. A rank holds 16384 / 4 tokens; the
    dense optimizer shards over DP x CP = 16 (Megatron's data-parallel group with CP)."""
    spec, layout = paper.ARCHITECTURES["qwen3_14b"], paper.LAYOUTS["qwen3_14b"]
    est = memory.memory_estimate(spec, layout)
    params = memory.params_per_gpu(spec, layout)
    assert est.weights == 2 * params and est.optimizer == pytest.approx(12 * params / (4 * 4))
    tokens = 16384 // 4
    assert est.logits == pytest.approx(tokens * 152064 / 4 * 4)
    # per token and layer: two RMSNorms (10 h each, / TP with sequence parallelism), q/k norms
    # and attention (14 (q + kv)), the fused SwiGLU MLP (6 ffn on CUDA), all / TP
    per_layer = (20 * 5120 + 14 * (5120 + 1024) + 6 * 17408) / 4
    assert memory.kept_layer_bytes(spec, layout) == per_layer
    assert est.activations == pytest.approx((40 + 1) * per_layer * tokens)  # every layer + one layer's gradients
    # CP divides what scales with tokens, nothing else
    half = memory.memory_estimate(spec, layout.replace(context_parallel_size=2))  # DP=8: DP x CP = 16
    assert (half.weights, half.grads, half.optimizer) == (est.weights, est.grads, est.optimizer)
    assert half.activations == pytest.approx(2 * est.activations) and half.logits == pytest.approx(2 * est.logits)


def test_memory_estimate_of_30b_a3b_by_hand():
    """Experts per EP shard: EP=16, ETP=1 gives each rank 8 whole experts of each of the 48 layers;
    their optimizer states shard over the expert data-parallel size world / (ETP x EP x PP) = 2,
    the dense parameters' over DP x CP = 8."""
    spec, layout = paper.ARCHITECTURES["qwen3_30b_a3b"], paper.LAYOUTS["qwen3_30b_a3b"]
    assert (layout.expert_model_parallel_size, layout.expert_tensor_size, layout.expert_data_parallel_size) == (
        16, 1, 2)
    experts = memory.expert_params_per_gpu(spec, layout)
    assert experts == 48 * 8 * 3 * 2048 * 768
    dense = memory.params_per_gpu(spec, layout) - experts
    attention = 2048 * (4096 + 2 * 512) + 4096 * 2048
    vocab = 152064  # 151936 padded to a multiple of 128 x TP
    assert dense == 48 * (attention + 2048 * 128 + 2 * 2048 + 2 * 128) // 4 + 2 * (vocab // 4 * 2048) + 2048
    est = memory.memory_estimate(spec, layout)
    assert est.weights == 2 * (dense + experts) and est.grads == 4 * (dense + experts)
    assert est.optimizer == pytest.approx(12 * (dense / 8 + experts / 2))
    # the one recomputed layer routes each of its tokens to 8 experts (x the imbalance allowance)
    copies = 8 * memory.MOE_ROUTING_IMBALANCE
    one_layer = 2 * (4 * 2048 / 4 + (2 * 4096 + 2 * 512) / 4 + copies * (3 * 768 + 2048 / 4)) * 16384
    assert est.activations == pytest.approx(2 * 2048 / 4 * 16384 * 48 + 2 * one_layer)
    assert est.vllm_kv_tokens == int((0.4 * 80 * 2**30 - 2 * hf_config.num_params(spec) / 4 - 2e9)
                                     / (2 * 48 * 512 * 2 / 4))
    # EP = 8 on the same GPUs holds twice the experts: 79.7 GB, at the budget's edge
    ep8 = memory.memory_estimate(spec, layout.replace(expert_model_parallel_size=8))
    assert ep8.weights - est.weights == pytest.approx(2 * experts)


def test_layout_problems_checks_the_per_rank_budget_itself():
    """layout_problems names a budget below one CP rank's share of the longest sequence even for a
    config changed after construction (TrainerConfig refuses it when it is built)."""
    cfg = paper.qwen3_8b()
    cfg.max_tokens_per_microbatch = 4000
    problems = paper.layout_problems(paper.ARCHITECTURES["qwen3_8b"], paper.layout_for("qwen3_8b", cfg), cfg)
    assert problems == ["max_tokens_per_microbatch 4000 < the longest sequence data.max_prompt_len + "
                        "rollout.max_response_len = 1024 + 15360 = 16384, padded to a multiple of 16, over "
                        "context_parallel_size 2 = 8192 tokens per rank (a sequence is never split between "
                        "micro-batches; context parallelism splits it over its ranks)"]
    # an odd length rounds up to whole 2 x CP chunks: 16385 tokens over CP 4 -> 8 chunks of 2049
    assert alignment.rank_tokens(16385, 4) == 2 * 2049 and alignment.rank_tokens(16385, 1) == 16385


def test_dry_run_layout_line_shows_cp_and_ep():
    """The line the launcher's dry run prints (`memory.describe`)."""
    line = memory.describe(paper.ARCHITECTURES["qwen3_14b"], paper.LAYOUTS["qwen3_14b"])
    assert line.startswith("8 x 8 GPUs: TP=4 PP=1 CP=4 DP=4; 16384-token sequences (4096 per CP rank), "
                           "recompute none; vLLM TP=4 at 0.35 of the card; ")
    assert line.endswith(" = 71.9 GB of 80 GB")
    line = memory.describe(paper.ARCHITECTURES["qwen3_30b_a3b"], paper.LAYOUTS["qwen3_30b_a3b"])
    assert "TP=4 PP=1 CP=1 EP=16 ETP=1 DP=8;" in line and "recompute full" in line
    # separate placement: the engine GPU's weight transfer beside vLLM's share
    # (`engine_staging_bytes`: 1.86e9 bytes for Qwen3-8B at vLLM TP=4, 512 MiB buckets)
    line = memory.describe(paper.ARCHITECTURES["qwen3_8b"], paper.LAYOUTS["qwen3_8b_async"])
    assert "16 generate (4 vLLM engines of TP=4 at 0.85 of the card, 1.9 GB of weight buckets beside it" in line
    assert memory.engine_staging_bytes(paper.ARCHITECTURES["qwen3_8b"], paper.LAYOUTS["qwen3_8b_async"]) == 1857822720


@pytest.mark.parametrize("fields, lora_fields", [
    ({}, {}),
    ({}, dict(target_modules=["linear_qkv", "linear_fc2"])),
    (dict(architecture="Qwen3MoeForCausalLM", num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32),
     dict(experts=True)),
])
def test_adapter_parameters_are_what_apply_lora_adds(parallel, fields, lora_fields):
    """`adapter_params_per_gpu` against the adapters of a real model (TP = 1)."""
    from stapo_megatron.bridge.tiny import tiny_qwen3_spec
    from stapo_megatron.mcore.lora import adapter_parameters, apply_lora
    from stapo_megatron.mcore.lora_config import LoraConfig
    from tests.helpers.lora_models import VOCAB, tiny_gpt

    model, config = tiny_gpt(**fields), LoraConfig(rank=4, **lora_fields)
    apply_lora(model, config)
    layout = memory.ParallelLayout(num_nodes=1, gpus_per_node=1, model=ModelConfig(), vllm_tensor_parallel_size=1,
                                   vllm_gpu_memory_utilization=0.3, lora_rank=4, lora_experts=config.experts,
                                   lora_targets=tuple(config.target_modules))
    spec = tiny_qwen3_spec(vocab_size=VOCAB, **fields)
    assert memory.adapter_params_per_gpu(spec, layout) == sum(p.numel() for p in adapter_parameters(model)) > 0


def test_lora_trains_the_adapters_only_and_its_reference_is_free():
    spec = paper.ARCHITECTURES["qwen3_14b"]
    full = paper.LAYOUTS["qwen3_14b"].replace(reference_model=True)
    lora = full.replace(lora_rank=16)
    a, b = memory.memory_estimate(spec, full), memory.memory_estimate(spec, lora)
    adapters = memory.adapter_params_per_gpu(spec, lora)
    # r = 16 on q/k/v, o, gate/up and down of 40 layers, TP = 4: A whole, B split (column) or the reverse (row)
    h, q, kv, f = 5120, 5120, 1024, 17408
    assert adapters == 40 * 16 * ((h + (q + 2 * kv) // 4) + (q // 4 + h) + (h + 2 * f // 4) + (f // 4 + h))
    assert b.weights == a.weights + 2 * adapters, "the frozen base stays, bf16, and the adapters join it"
    assert b.grads == 4 * adapters and a.grads > 100 * b.grads  # 23.4M of 3.69G parameters per GPU
    dense_shards = full.data_parallel_size * full.context_parallel_size
    assert b.optimizer == 12 * adapters / dense_shards
    assert a.reference == a.weights and b.reference == 0, "LoRA's reference is its own base"
    assert (b.activations, b.logits) == (a.activations, a.logits)
    assert "LoRA r=16" in memory.describe(spec, lora)


def test_a_lora_rank_wider_than_a_linear_is_named_with_the_layout():
    """`lora_rank_problems` in the recipes' check (the dry run): the dense linears, the experts'
    only when adapted."""
    from stapo_megatron.config.overrides import apply_overrides

    dense = paper.ARCHITECTURES["qwen3_8b"]  # hidden 4096, 32 x 128 query and 8 x 128 key/value rows, MLP 12288
    layout = paper.LAYOUTS["qwen3_8b"]
    assert memory.lora_rank_problems(dense, layout.replace(lora_rank=4096)) == []
    assert memory.lora_rank_problems(dense, layout.replace(lora_rank=5000)) == [
        "lora.rank 5000 is larger than linear_qkv's smaller dimension 4096 (in 4096, out 6144)",
        "lora.rank 5000 is larger than linear_proj's smaller dimension 4096 (in 4096, out 4096)",
        "lora.rank 5000 is larger than linear_fc1's smaller dimension 4096 (in 4096, out 24576)",
        "lora.rank 5000 is larger than linear_fc2's smaller dimension 4096 (in 12288, out 4096)",
    ]
    # Qwen3-30B-A3B: attention 2048 wide, no dense MLP; the experts' down projection 768
    moe, moe_layout = paper.ARCHITECTURES["qwen3_30b_a3b"], paper.LAYOUTS["qwen3_30b_a3b"].replace(lora_rank=1000)
    assert memory.lora_rank_problems(moe, moe_layout) == []
    assert memory.lora_rank_problems(moe, moe_layout.replace(lora_experts=True)) == [
        "lora.rank 1000 is larger than linear_fc2's smaller dimension 768 (in 768, out 2048)"]
    cfg = apply_overrides(paper.qwen3_8b(), {"lora.rank": 5000})
    with pytest.raises(ValueError, match=r"recipe qwen3_8b cannot run:\n  - lora.rank 5000 is larger than "
                                         r"linear_qkv's smaller dimension 4096"):
        paper.check_paper_config("qwen3_8b", cfg, check_paths=False)
