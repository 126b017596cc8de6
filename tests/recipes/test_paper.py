"""The paper recipes (stapo_megatron/recipes/paper.py) and the launch overrides (launch/entry.py).

Tier a: pure configuration, no processes. Each recipe must be internally consistent on its
layout, fit the 80 GB memory estimate, and a bad override must fail with a message naming it.
"""

import dataclasses

import pytest

from stapo_megatron.batch import alignment
from stapo_megatron.bridge import hf_config
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.data.examples import SUFFIX
from stapo_megatron.launch.entry import build_config
from stapo_megatron.recipes import memory, paper
from stapo_megatron.recipes.tiny import tiny_demo
from tests.helpers import REPO_DIR

SIZES = sorted(paper.LAYOUTS)
PATHS = {"model": {"hf_dir": "/m/hf", "megatron_ckpt": "/m/ckpt"},
         "data": {"train_path": "/d/dapo.parquet", "eval_path": "/d/eval.jsonl"}}


@pytest.mark.parametrize("size", SIZES)
def test_recipe_is_consistent_with_its_layout(size):
    spec, layout, cfg = paper.ARCHITECTURES[size], paper.LAYOUTS[size], paper.paper_recipe(size)
    tp, pp = cfg.model.tensor_model_parallel_size, cfg.model.pipeline_model_parallel_size
    cp, ep = cfg.model.context_parallel_size, cfg.model.expert_model_parallel_size
    dp, vtp = layout.data_parallel_size, cfg.rollout.tensor_parallel_size
    assert (tp, pp, cp, ep, vtp) == (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                                     layout.context_parallel_size, layout.expert_model_parallel_size,
                                     layout.vllm_tensor_parallel_size)
    assert cfg.model.expert_tensor_parallel_size == layout.expert_tensor_parallel_size
    assert spec.num_attention_heads % tp == 0 and spec.num_query_groups % tp == 0
    assert spec.num_layers % pp == 0
    assert layout.world_size - cfg.rollout.engine_ranks == tp * pp * dp * cp  # separate placement: less the engines
    assert cfg.prompts_per_step % cfg.minibatch_prompts == 0
    assert cfg.minibatch_prompts % dp == 0
    assert (cfg.minibatch_prompts * cfg.rollout.group_size) % (dp * cfg.micro_batch_size) == 0
    assert layout.gpus_per_node % vtp == 0 and layout.world_size % vtp == 0 and tp % vtp == 0
    assert cfg.model.sequence_parallel == (tp > 1)
    assert cfg.model.recompute_granularity == layout.recompute_granularity
    # the packing budget is one CP rank's share of the longest sequence, the estimate's tokens
    longest = cfg.data.max_prompt_len + cfg.rollout.max_response_len
    assert longest == layout.seq_len and cfg.packing == "budget"
    assert cfg.max_tokens_per_microbatch == alignment.rank_tokens(longest, cp) == -(-longest // cp)
    if spec.is_moe:
        assert spec.num_moe_experts % ep == 0 and layout.world_size % (ep * layout.expert_tensor_size * pp) == 0
    assert memory.memory_estimate(spec, layout).total < memory.GPU_MEMORY_BYTES
    assert paper.layout_problems(spec, layout, cfg) == []


def test_14b_targets_8_nodes():
    layout = paper.LAYOUTS["qwen3_14b"]
    assert (layout.num_nodes, layout.gpus_per_node) == (8, 8)
    assert layout.tensor_model_parallel_size in (4, 8) and layout.pipeline_model_parallel_size in (1, 2)
    assert 2 <= layout.vllm_tensor_parallel_size <= 4


def test_8b_and_14b_use_cp_to_drop_full_recomputation():
    """Issue 23: CP makes room for every layer's activations (no recomputation) at 8B and 14B,
    and the 32k variant trains 32k-token sequences; with full recomputation dropped and CP = 1
    the same layouts exceed the budget (so CP is what makes them fit)."""
    for size in ("qwen3_8b", "qwen3_8b_32k", "qwen3_14b"):
        layout = paper.LAYOUTS[size]
        assert layout.context_parallel_size > 1 and layout.recompute_granularity is None
        without_cp = layout.replace(context_parallel_size=1)
        assert memory.memory_estimate(paper.ARCHITECTURES[size], without_cp).total > memory.GPU_MEMORY_BYTES
    cfg = paper.qwen3_8b_32k()
    assert cfg.data.max_prompt_len + cfg.rollout.max_response_len == 32768 == paper.ARCHITECTURES[
        "qwen3_8b_32k"].max_position_embeddings
    assert cfg.eval.max_response_len >= cfg.rollout.max_response_len
    assert (cfg.model.context_parallel_size, cfg.max_tokens_per_microbatch) == (4, 8192)


@pytest.mark.parametrize("size, total, non_embedding", [
    ("qwen3_1p7b", 1.7, 1.4), ("qwen3_8b", 8.2, 6.9), ("qwen3_14b", 14.8, 13.2), ("qwen3_30b_a3b", 30.5, 29.9)])
def test_parameter_counts_match_the_model_cards(size, total, non_embedding):
    spec = paper.ARCHITECTURES[size]
    embeddings = spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    # the model cards give one decimal (8B: 6.95B non-embedding)
    assert round(hf_config.num_params(spec) / 1e9, 1) == total
    assert round((hf_config.num_params(spec) - embeddings) / 1e9, 1) == non_embedding


def test_30b_a3b_measures_routing_every_tenth_step():
    # one more no-grad forward over the step's samples: a diagnostic, not every step at scale
    assert paper.paper_recipe("qwen3_30b_a3b").rollout.routing_every == paper.ROUTING_EVERY == 10


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


def _full_recompute(layout, **changes):
    return layout.replace(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, **changes)


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
    # and attention (14 (q + kv)), the SwiGLU MLP (10 ffn), all / TP
    per_layer = (20 * 5120 + 14 * (5120 + 1024) + 10 * 17408) / 4
    assert memory.kept_layer_bytes(spec, layout) == per_layer
    assert est.activations == pytest.approx((40 + 1) * per_layer * tokens)  # every layer + one layer's gradients
    # CP divides what scales with tokens, nothing else
    half = memory.memory_estimate(spec, layout.replace(context_parallel_size=2))  # DP=8: DP x CP = 16
    assert (half.weights, half.grads, half.optimizer) == (est.weights, est.grads, est.optimizer)
    assert half.activations == pytest.approx(2 * est.activations) and half.logits == pytest.approx(2 * est.logits)


def test_no_recompute_estimate_matches_the_h100_measurement():
    """benchmarks/RESULTS.md (H100, 2026-11-24, bench_gpu_step.py): Qwen3-1.7B, TP=1, 4 micro-batches
    of one sequence. Without recomputation at 8192 tokens 69.8 GB allocated; full recomputation at
    16384 tokens 43.2 GB. The estimate without its allowance: 70.5 GB (+1.0%) and 45.0 GB (+4.1%).
    Tolerance 5%: the written model is meant to be within a few percent, not exact."""
    spec = dataclasses.replace(paper.ARCHITECTURES["qwen3_1p7b"], max_position_embeddings=40960)
    bench = memory.ParallelLayout(num_nodes=1, gpus_per_node=1, vllm_tensor_parallel_size=1,
                                  vllm_gpu_memory_utilization=0.0,
                                  model=ModelConfig(recompute_granularity="full", recompute_method="uniform",
                                                    recompute_num_layers=1))
    for layout, seq_len, measured in ((bench.replace(**paper._NO_RECOMPUTE), 8192, 69.8),
                                      (bench, 16384, 43.2)):
        est = memory.memory_estimate(spec, layout, seq_len=seq_len)
        assert (est.training - est.overhead) / memory.GB == pytest.approx(measured, rel=0.05)
    # selective recomputation (the core attention, which keeps its inputs) is counted as none;
    # the H100 run was out of memory at 16k with both
    none = bench.replace(**paper._NO_RECOMPUTE)
    selective = none.replace(recompute_granularity="selective")
    assert memory.memory_estimate(spec, selective, 16384) == memory.memory_estimate(spec, none, 16384)
    assert memory.memory_estimate(spec, none, 16384).training > memory.GPU_MEMORY_BYTES
    with pytest.raises(ValueError, match="recompute_granularity must be one of"):
        memory.memory_estimate(spec, bench.replace(recompute_granularity="block"))
    with pytest.raises(ValueError, match="recompute_num_layers 1"):
        memory.memory_estimate(spec, bench.replace(recompute_num_layers=2))


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


@pytest.mark.parametrize("size", sorted(paper.LAYOUTS))
def test_grpo_reference_model_fits_within_the_budget(size):
    """GRPO keeps a bf16 reference copy (2 B/param of the shard): counted, and the recipe's vLLM
    share leaves room for it."""
    cfg = paper.paper_recipe(size, "grpo")
    layout = paper.layout_for(size, cfg)
    est = memory.memory_estimate(paper.ARCHITECTURES[size], layout)
    assert layout.reference_model and est.reference == est.weights
    assert est.total < memory.GPU_MEMORY_BYTES
    assert paper.layout_problems(paper.ARCHITECTURES[size], layout, cfg) == []
    # the reference is the difference, less what a smaller vLLM share gives back (8B, 14B: with CP
    # and no recomputation their vLLM share drops by 0.05 beside the reference)
    base = memory.memory_estimate(paper.ARCHITECTURES[size], paper.layout_for(size, paper.paper_recipe(size)))
    assert est.total - base.total == pytest.approx(est.reference + est.vllm - base.vllm)


def test_retention_and_time_fit_a_3000_step_run():
    """keep_last bounds the disk (14B: ~200 GB a checkpoint); the save signal exceeds a step plus a
    save; the requeue budget covers the estimated run at the 4 h default limit."""
    from stapo_megatron.recipes import step_time

    for size in paper.LAYOUTS:
        cfg = paper.paper_recipe(size)
        assert (cfg.save_every, cfg.keep_last) == (10, 3)
        step = step_time.estimate_step_time(paper.ARCHITECTURES[size], paper.LAYOUTS[size], cfg)
        assert 60 < step.rollout_s < 3600 and 60 < step.training_s < 3600
        signal_s = step_time.signal_seconds(step)
        assert signal_s >= step.total_s + step_time.SAVE_S and signal_s % 60 == 0
        jobs = step_time.jobs_needed(cfg.steps, step, 4 * 3600, signal_s)
        useful = 4 * 3600 - signal_s - step_time.JOB_STARTUP_S
        assert (jobs - 1) * useful < cfg.steps * step.total_s <= jobs * useful
    assert step_time.parse_slurm_time("1-02:03:04") == 93784
    assert step_time.parse_slurm_time("04:00:00") == 14400 and step_time.parse_slurm_time("90") == 5400
    with pytest.raises(ValueError, match="less than one step"):
        step_time.jobs_needed(3000, step, 1800, 600)


def test_justrl_hyperparameters():
    cfg = paper.qwen3_14b()
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.clip_grad, cfg.lr_warmup_steps) == (1e-6, 0.1, 1.0, 10)
    assert (cfg.steps, cfg.eval.every, cfg.eval.max_response_len) == (3000, 20, 20480)
    assert (cfg.reward.name, cfg.data.prompt_template) == ("boxed_exact_match", "{question}\n" + SUFFIX)
    assert (cfg.loss.clip_ratio_c, cfg.loss.tau_h_source) == (10.0, "exact")
    assert cfg.optim.use_distributed_optimizer and cfg.model.bf16
    assert (cfg.prompts_per_step, cfg.rollout.group_size, cfg.minibatch_prompts) == (256, 8, 64)
    assert (cfg.data.max_prompt_len, cfg.rollout.max_response_len) == (1024, 15360)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.loss.temperature) == (1.0, 1.0, 1.0)
    assert (cfg.loss.clip_ratio_low, cfg.loss.clip_ratio_high, cfg.loss.kl_coef) == (0.2, 0.28, 0.0)
    assert (cfg.loss.method, cfg.loss.tau_p, cfg.loss.entropy_quantile) == ("stapo", 0.002, 0.75)


@pytest.mark.parametrize("method, expected", [
    ("stapo", dict(method="stapo", tau_p=0.002, entropy_quantile=0.75)),
    ("justrl", dict(method="justrl")),
    ("entropy20", dict(method="entropy20", entropy_top_fraction=0.2)),
    ("random", dict(method="random", tau_p=0.002, entropy_quantile=0.75)),
    ("random_uniform", dict(method="random_uniform", tau_p=0.002, entropy_quantile=0.75)),
])
def test_method_override_sets_only_the_loss(method, expected):
    cfg, _ = build_config("qwen3_8b", method=method, check_paths=False)
    for key, value in expected.items():
        assert getattr(cfg.loss, key) == value
    assert (cfg.loss.clip_ratio_low, cfg.loss.clip_ratio_high, cfg.loss.kl_coef) == (0.2, 0.28, 0.0)
    base = paper.qwen3_8b(run_dir=cfg.run_dir)
    assert dataclasses.replace(cfg, loss=base.loss) == base


def test_grpo_is_deepseekmath_grpo_and_shares_the_rest():
    cfg, _ = build_config("qwen3_8b", method="grpo", check_paths=False)
    loss = cfg.loss
    assert (loss.clip_ratio_low, loss.clip_ratio_high, loss.clip_ratio_c, loss.kl_coef) == (0.2, 0.2, None, 0.04)
    base = paper.qwen3_8b(run_dir=cfg.run_dir)
    # beside the reference model vLLM gets a smaller share (ParallelLayout.vllm_gpu_memory_utilization_with_reference)
    assert (cfg.rollout.gpu_memory_utilization, base.rollout.gpu_memory_utilization) == (0.35, 0.4)
    assert dataclasses.replace(cfg, loss=base.loss, rollout=base.rollout) == base
    assert dataclasses.replace(cfg.rollout, gpu_memory_utilization=0.4) == base.rollout
    assert dataclasses.replace(loss, method="stapo", clip_ratio_high=0.28, clip_ratio_c=10.0, kl_coef=0.0) == base.loss


def test_tiny_recipe_is_the_demo():
    assert build_config("tiny") == tiny_demo(run_dir="runs/demo", method="stapo")


def test_overrides_reach_nested_fields():
    cfg, warmstart = build_config("tiny", "justrl", "runs/x", steps=1, rollout={"max_response_len": 8},
                                  warmstart={"steps": 2}, **{"optim.lr": 1e-4})
    assert (cfg.run_dir, cfg.model.hf_dir, cfg.loss.method) == ("runs/x", "runs/x/model", "justrl")
    assert (cfg.steps, cfg.rollout.max_response_len, cfg.optim.lr, warmstart.steps) == (1, 8, 1e-4, 2)
    cfg, _ = build_config("qwen3_14b", model={"tensor_model_parallel_size": 8, **PATHS["model"]}, data=PATHS["data"])
    assert cfg.model.tensor_model_parallel_size == 8 and cfg.data.train_path == "/d/dapo.parquet"


@pytest.mark.parametrize("overrides, message", [
    (dict(stepz=1), "unknown override stepz: TrainerConfig has no field 'stepz'"),
    (dict(rollout={"max_len": 8}), "unknown override rollout.max_len: RolloutSampling has no field 'max_len'"),
    (dict(steps="many"), "override steps='many': expected int, got str"),
    (dict(model={"bf16": 1}), "override model.bf16=1: expected bool, got int"),
    (dict(loss={"method": "ppo"}), "method must be one of"),
    (dict(method="ppo"), "method must be one of"),
    (dict(recipe="qwen3_70b"), "recipe must be one of"),
    (dict(warmstart={"steps": 3}), "recipe qwen3_14b has no warm-start"),
    # (TP 3 with sequence parallelism pads a sequence to a multiple of 2 x CP 4 x 3 = 24: 4098 per rank)
    (dict(model={"tensor_model_parallel_size": 3}, rollout={"tensor_parallel_size": 1}, max_tokens_per_microbatch=4098),
     "num_attention_heads 40 is not divisible by tensor_model_parallel_size 3"),
    # the trainer's own config refuses it before the layout check (vLLM TP 4 of the recipe)
    (dict(model={"tensor_model_parallel_size": 3}, max_tokens_per_microbatch=4098), "vLLM TP 4 must divide Megatron TP 3"),
    (dict(rollout={"tensor_parallel_size": 8}), "vLLM TP 8 must divide Megatron TP 4"),
    (dict(rollout={"gpu_memory_utilization": 0.6}), "exceeds 80 GB"),
    (dict(minibatch_prompts=48), "prompts_per_step 256 is not divisible by minibatch_prompts 48"),
])
def test_bad_override_fails_clearly(overrides, message):
    kwargs = dict(recipe="qwen3_14b", check_paths=False)
    kwargs.update(overrides)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config(**kwargs)


def test_missing_paths_are_named():
    with pytest.raises(ValueError) as info:
        build_config("qwen3_1p7b")
    for field in ("model.hf_dir", "model.megatron_ckpt", "data.train_path", "data.eval_path"):
        assert f"{field} is not set" in str(info.value)
    build_config("qwen3_1p7b", **PATHS)  # complete


def test_layout_is_checked_on_the_gpus_of_the_job():
    build_config("qwen3_14b", check_paths=False, num_nodes=16, gpus_per_node=8)  # DP=8 fits
    # two nodes: DP=1, so DP x CP = 4 shards of the Adam states (11 GB per GPU)
    with pytest.raises(ValueError, match="exceeds 80 GB"):
        build_config("qwen3_14b", check_paths=False, num_nodes=2, gpus_per_node=8)
    with pytest.raises(ValueError, match=r"8 GPUs are not divisible by TP 4 x PP 1 x CP 4"):
        build_config("qwen3_14b", check_paths=False, num_nodes=1, gpus_per_node=8)
    with pytest.raises(ValueError, match="TP 4 must divide the 3 GPUs of a node"):
        build_config("qwen3_14b", check_paths=False, num_nodes=16, gpus_per_node=3)


@pytest.mark.parametrize("recipe, overrides, message", [
    # CP: the GPUs, the node topology, the packing, the per-rank budget, DP without CP
    ("qwen3_14b", dict(model={"context_parallel_size": 3}, max_tokens_per_microbatch=5464), "64 GPUs are not divisible by TP 4 x PP 1 x CP 3"),
    # CP = 2 leaves 8k tokens per rank: without recomputation the 14B does not fit
    ("qwen3_14b", dict(model={"context_parallel_size": 2}, max_tokens_per_microbatch=8192), "exceeds 80 GB"),
    # (the trainer's config refuses it first)
    ("qwen3_8b", dict(packing="padded"), "model.context_parallel_size 2 needs packed micro-batches: packing='fixed'"),
    ("qwen3_8b", dict(max_tokens_per_microbatch=8000),
     "max_tokens_per_microbatch 8000 < the longest sequence data.max_prompt_len + rollout.max_response_len = "
     "1024 + 15360 = 16384, padded to a multiple of 16, over context_parallel_size 2 = 8192 tokens per rank"),
    ("qwen3_8b", dict(model={"context_parallel_size": 3}, max_tokens_per_microbatch=5464, num_nodes=3),
     "TP 4 x CP 3 must divide the 8 GPUs of a node or span whole nodes"),
    ("qwen3_14b", dict(minibatch_prompts=32, prompts_per_step=96, num_nodes=48),
     "minibatch_prompts 32 is not divisible by DP 24"),
    ("qwen3_14b", dict(model={"cp_comm_type": "a2a", "context_parallel_size": 8}, max_tokens_per_microbatch=2048),
     "num_query_groups 8 is not divisible by TP 4 x CP 8 (cp_comm_type 'a2a')"),
    # EP: experts over EP, widths over ETP, expert groups over the GPUs, a dense model
    ("qwen3_30b_a3b", dict(model={"expert_model_parallel_size": 24}),
     "num_moe_experts 128 is not divisible by expert_model_parallel_size 24"),
    ("qwen3_30b_a3b", dict(model={"expert_model_parallel_size": 64}),
     "32 GPUs are not divisible by ETP 1 x EP 64 x PP 1 (Megatron's expert groups)"),
    ("qwen3_30b_a3b", dict(model={"expert_tensor_parallel_size": 5}),
     "moe_ffn_hidden_size 768 is not divisible by expert_tensor_parallel_size 5"),
    ("qwen3_14b", dict(model={"expert_model_parallel_size": 2}),
     "expert_model_parallel_size 2 / expert_tensor_parallel_size None need an MoE model (Qwen3ForCausalLM has no experts)"),
    ("qwen3_30b_a3b", dict(model={"tensor_model_parallel_size": 8}, rollout={"tensor_parallel_size": 8}),
     "num_query_groups 4 is not divisible by tensor_model_parallel_size 8"),
])
def test_cp_and_ep_layout_errors_are_clear(recipe, overrides, message):
    kwargs = dict(check_paths=False)
    kwargs.update(overrides)
    with pytest.raises(ValueError) as info:
        build_config(recipe, **kwargs)
    assert message in str(info.value), str(info.value)


def test_memory_settings_reach_megatron_transformer_config():
    """The recipe's sequence parallelism / recomputation are valid Megatron TransformerConfig fields."""
    from stapo_megatron.bridge.transformer_config import transformer_config_from_spec

    cfg = paper.qwen3_1p7b()
    settings = cfg.model.memory_settings()
    assert settings == dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=1)
    tc = transformer_config_from_spec(paper.ARCHITECTURES["qwen3_1p7b"], cfg.model.tensor_model_parallel_size,
                                      cfg.model.pipeline_model_parallel_size, **settings)
    assert tc.sequence_parallel and tc.recompute_granularity == "full" and tc.recompute_num_layers == 1
    cfg = paper.qwen3_14b()  # CP makes room for every activation: no recomputation
    assert cfg.model.memory_settings() == dict(sequence_parallel=True)
    bad = dataclasses.replace(cfg.model, tensor_model_parallel_size=1)
    with pytest.raises(ValueError, match="sequence_parallel needs tensor_model_parallel_size > 1"):
        bad.memory_settings()


def test_prepare_tiny_model_refuses_a_foreign_folder(tmp_path):
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="no config.json"):
        prepare_tiny_model(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert not list(tmp_path.parent.glob(f"{tmp_path.name}.tmp-*")), "no temporary folder left behind"


def test_readme_memory_table_is_current():
    """README.md's memory table is what `scripts/memory_table.py` writes from `memory_estimate`
    (run `python scripts/memory_table.py` after changing a layout or the memory model)."""
    import importlib.util
    import os

    root = REPO_DIR
    spec = importlib.util.spec_from_file_location("memory_table", os.path.join(root, "scripts", "memory_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        assert module.block() in f.read(), "README.md's memory table is stale: run python scripts/memory_table.py"


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
    assert line.endswith(" = 74.8 GB of 80 GB")
    line = memory.describe(paper.ARCHITECTURES["qwen3_30b_a3b"], paper.LAYOUTS["qwen3_30b_a3b"])
    assert "TP=4 PP=1 CP=1 EP=16 ETP=1 DP=8;" in line and "recompute full" in line
