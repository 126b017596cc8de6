"""Tier a: the LoRA recipes (`stapo_megatron.recipes.lora`): the paper's protocol with adapters on
one node, a 32B that full fine-tuning cannot fit there, the memory and step-time models' numbers
for both, and the launcher's view of them (`recipe_module`, `entry.build_config`)."""

import dataclasses

import pytest

from stapo_megatron.bridge.hf_config import num_params
from stapo_megatron.recipes import lora, memory, paper, step_time

GB = memory.GB


@pytest.mark.parametrize("size", sorted(lora.LAYOUTS))
def test_a_lora_recipe_is_the_paper_protocol_with_adapters_on_one_node(size):
    cfg, full = lora.paper_recipe(size), paper.paper_recipe("qwen3_14b")
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules) == (
        32, 32.0, ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    assert cfg.optim.lr == pytest.approx(10 * full.optim.lr) and cfg.optim.lr == 1e-5  # LoRA Without Regret: x10
    assert (cfg.steps, cfg.prompts_per_step, cfg.rollout.group_size, cfg.loss, cfg.reward, cfg.data) == (
        full.steps, full.prompts_per_step, full.rollout.group_size, full.loss, full.reward, full.data)
    assert (cfg.model.tensor_model_parallel_size, cfg.rollout.tensor_parallel_size, cfg.max_tokens_per_microbatch) \
        == (8, 8, 16384)
    layout = lora.layout_for(size, cfg)
    assert (layout.world_size, layout.lora_rank) == (8, 32)
    lora.check_paper_config(size, cfg, check_paths=False)  # no problem
    with pytest.raises(ValueError, match=r"model.hf_dir is not set \(the HF folder of Qwen3-"):
        lora.check_paper_config(size, cfg)
    assert lora.recipe_module(size) is lora and lora.recipe_module("qwen3_14b") is paper


def test_the_32b_is_qwen3_32b():
    # 64 x (attention 5120 x (8192 + 2048) + 8192 x 5120 + MLP 3 x 5120 x 25600 + norms) + embeddings
    assert num_params(lora.QWEN3_32B) == 32_762_123_264
    assert (lora.QWEN3_32B.num_layers, lora.QWEN3_32B.num_attention_heads, lora.QWEN3_32B.num_query_groups) == \
        (64, 64, 8)


def test_full_fine_tuning_cannot_fit_the_32b_on_the_node_and_lora_does():
    """The memory model refuses the 32B's full fine-tune on the recipe's 8 GPUs (81.3 GB of
    training state alone: weights 8.2, fp32 grads 16.4, Adam 49.2 GB a GPU at DP = 1) and
    accepts the adapters (16.9 GB of training); the 14B's full fine-tune does not fit beside the
    recipe's vLLM share either."""
    spec, cfg = lora.QWEN3_32B, lora.paper_recipe("qwen3_32b_lora")
    full = memory.memory_estimate(spec, lora.layout_for("qwen3_32b_lora", dataclasses.replace(cfg, lora=None)))
    assert full.as_gb()["training"] == pytest.approx(81.3, abs=0.05) and full.training > memory.GPU_MEMORY_BYTES
    assert full.optimizer == pytest.approx(12 * memory.params_per_gpu(spec, lora.LAYOUTS["qwen3_32b_lora"]), rel=1e-12)
    problems = lora.full_finetune_problems("qwen3_32b_lora")
    assert problems[0].startswith("estimated 128.5 GB per GPU exceeds 80 GB")
    assert "vLLM would refuse to start" in problems[1]
    est = memory.memory_estimate(spec, lora.layout_for("qwen3_32b_lora", cfg))
    assert (round(est.training / GB, 1), round(est.total / GB, 1)) == (16.9, 64.2)
    assert lora.full_finetune_problems("qwen3_14b_lora")[0].startswith("estimated 87.3 GB per GPU exceeds 80 GB")
    est14 = memory.memory_estimate(paper.ARCHITECTURES["qwen3_14b"], lora.layout_for("qwen3_14b_lora",
                                                                                     lora.qwen3_14b_lora()))
    assert (round(est14.training / GB, 1), round(est14.total / GB, 1), est14.reference) == (11.1, 58.4, 0.0)


def test_the_dry_runs_step_time():
    """The step-time model with LoRA (`step_model`: the update without the base's weight
    gradients): the 32B's step about twice the 14B's on the same node."""
    steps = {size: step_time.estimate_step_time(lora.ARCHITECTURES[size], lora.layout_for(size, cfg), cfg)
             for size, cfg in ((s, lora.paper_recipe(s)) for s in lora.LAYOUTS)}
    assert steps["qwen3_14b_lora"].total_s / 60 == pytest.approx(15.9, abs=0.05)
    assert steps["qwen3_32b_lora"].total_s / 60 == pytest.approx(32.2, abs=0.05)
    assert not any(s.overlapped for s in steps.values())


def test_the_launcher_builds_a_lora_recipe_with_its_overrides():
    from stapo_megatron.launch.entry import build_config

    cfg, warmstart = build_config("qwen3_32b_lora", check_paths=False, lora={"rank": 64}, optim={"lr": 2e-5})
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.optim.lr, warmstart) == (64, 32.0, 2e-5, None)
    assert build_config("qwen3_14b_lora", check_paths=False, lora={})[0].lora.rank == 32  # empty: unchanged
    assert build_config("qwen3_14b", check_paths=False, lora={})[0].lora is None  # no section: full fine-tuning
    with pytest.raises(ValueError, match=r"recipe qwen3_14b_lora cannot run:\n  - lora.rank 6000 is larger than "
                                         r"linear_qkv's smaller dimension 5120"):
        build_config("qwen3_14b_lora", check_paths=False, lora={"rank": 6000})
    with pytest.raises(ValueError, match=r"size must be one of \['qwen3_14b_lora', 'qwen3_32b_lora'\]"):
        lora.paper_recipe("qwen3_8b_lora")
