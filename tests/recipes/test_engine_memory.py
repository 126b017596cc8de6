"""Tier a: the engine's side of the memory model (`recipes.engine_memory`): vLLM's start beside
the trainer's model and optimizer (colocated) and the weight buckets beside a separately placed
engine's share, refused in the paper recipes' check with the numbers and the field to change."""

import dataclasses

import pytest

from stapo_megatron.bridge.hf_config import num_params
from stapo_megatron.recipes import engine_memory, memory, paper
from stapo_megatron.rollout import weight_buckets

QWEN3_8B = paper.ARCHITECTURES["qwen3_8b"]


def test_every_paper_layout_starts_its_engine():
    for size, layout in paper.LAYOUTS.items():
        assert engine_memory.engine_start_problems(paper.ARCHITECTURES[size], layout) == [], size


def test_free_memory_at_the_colocated_engine_start_is_the_card_less_the_trainers_state():
    layout = paper.LAYOUTS["qwen3_8b"]
    est = memory.memory_estimate(QWEN3_8B, layout)
    # Qwen3-8B at TP=4: 2.1e9 parameters a rank, 6 B each (bf16 weights, fp32 gradients), the
    # optimizer's 12 B over DP x CP = 8 ranks, 4 GB of framework overhead; no activations yet
    persistent = est.weights + est.grads + est.optimizer + memory.FRAMEWORK_OVERHEAD_BYTES
    assert engine_memory.free_at_engine_start(QWEN3_8B, layout) == pytest.approx(memory.GPU_TOTAL_BYTES - persistent)
    assert engine_memory.free_at_engine_start(QWEN3_8B, layout) / memory.GB == pytest.approx(66.5, abs=0.05)


@pytest.mark.parametrize("utilization, starts", [(0.77, True), (0.78, False)])
def test_vllm_asks_for_its_share_free_at_the_start(utilization, starts):
    """vLLM 0.33 refuses to start with less free than gpu_memory_utilization x the card:
    0.77 x 85.9 = 66.1 GB fits the 66.5 GB predicted free, 0.78 x 85.9 = 67.0 GB does not."""
    layout = paper.LAYOUTS["qwen3_8b"].replace(vllm_gpu_memory_utilization=utilization)
    problems = engine_memory.engine_start_problems(QWEN3_8B, layout)
    assert (problems == []) == starts
    if not starts:
        assert "rollout.gpu_memory_utilization=0.78 asks vLLM to find 67.0 GB free" in problems[0]
        assert "predicts 66.5 GB free" in problems[0] and "at most 0.77" in problems[0]


def test_the_paper_check_refuses_an_engine_that_cannot_start():
    cfg = paper.paper_recipe("qwen3_8b")
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gpu_memory_utilization=0.85))
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.85 asks vLLM to find 73.0 GB free .* predicts "
                                         r"66.5 GB free"):
        paper.check_paper_config("qwen3_8b", cfg, check_paths=False)


def test_a_separate_engine_gpu_holds_the_buckets_the_reload_keeps_and_one_materialised_layer():
    layout = paper.LAYOUTS["qwen3_8b_async"]  # vLLM TP=4 at 0.85 of the card: 12.9 GB left beside it
    embedding = 151936 * 4096 * 2  # Qwen3-8B's largest reload layer (bf16), a multiple of vLLM's padding
    # a bucket larger than the model: the whole model arrives at once and stays until its last
    # layer; the largest layer materialised beside it is the embedding's TP shard
    whole = layout.replace(weight_bucket_mb=20000)
    assert engine_memory.engine_staging_bytes(QWEN3_8B, whole) == num_params(QWEN3_8B) * 2 + embedding // 4
    # the default 512 MiB: the planner's replay of the stream (tests/rollout/test_weight_buckets.py
    # measures it through vLLM's reload); a model cut in buckets holds far less than the model
    staging = engine_memory.engine_staging_bytes(QWEN3_8B, layout)
    assert staging == weight_buckets.planned_staging_bytes(QWEN3_8B, 512 * 2**20, 2, 4)
    assert embedding < staging < 2 * embedding
    assert engine_memory.engine_staging_bytes(QWEN3_8B, paper.LAYOUTS["qwen3_8b"]) == 0  # colocated: one at a time
    assert engine_memory.engine_start_problems(QWEN3_8B, layout.replace(weight_bucket_mb=6000)) == []  # 12.6 GB
    problems = engine_memory.engine_start_problems(QWEN3_8B, layout.replace(weight_bucket_mb=6400))  # 16.4 GB
    assert len(problems) == 1 and "16.4 GB of buckets" in problems[0] and "rollout.separate.weight_bucket_mb=6400" in problems[0]


def test_a_moe_layer_larger_than_a_bucket_travels_alone_and_is_counted_twice():
    """Qwen3-30B-A3B: a layer's 128 experts (1.21 GB bf16) are one reload layer, larger than a
    512 MiB bucket: they travel as one bucket, and while vLLM materialises them the engine holds
    that bucket, the next one (the next layer's attention, norms and router, up to its experts),
    the one before (the layer's own attention: vLLM's name mapper keeps its last q/k/v shard until
    the next one) and the materialised experts."""
    spec = paper.ARCHITECTURES["qwen3_30b_a3b"]
    layout = paper.LAYOUTS["qwen3_30b_a3b"].replace(engine_ranks=8, vllm_tensor_parallel_size=1)
    H, heads, groups, d = spec.hidden_size, spec.num_attention_heads, spec.num_query_groups, spec.kv_channels
    experts = spec.num_moe_experts * 3 * spec.moe_ffn_hidden_size * H * 2
    attention = (heads * d * H + 2 * groups * d * H + H * heads * d + 2 * d) * 2
    attention_bucket = attention + 2 * H * 2 + spec.num_moe_experts * H * 2  # + two norms, the router
    assert experts == 1_207_959_552
    assert engine_memory.engine_staging_bytes(spec, layout) == 2 * experts + 2 * attention_bucket
