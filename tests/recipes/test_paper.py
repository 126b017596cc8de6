"""The paper recipes (stapo_megatron/recipes/paper.py) and the launch overrides (launch/entry.py).

Tier a: pure configuration, no processes. Each recipe must be internally consistent on its
layout, fit the 80 GB memory estimate, and a bad override must fail with a message naming it.
"""

import dataclasses

import pytest

from stapo_megatron.batch import alignment
from stapo_megatron.data.examples import SUFFIX
from stapo_megatron.launch.entry import build_config
from stapo_megatron.recipes import memory, paper
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
    assert layout.world_size - cfg.rollout.separate.engine_ranks == tp * pp * dp * cp  # separate placement: less the engines
    assert cfg.prompts_per_step % cfg.minibatch_prompts == 0
    assert cfg.minibatch_prompts % dp == 0
    assert (cfg.minibatch_prompts * cfg.rollout.group_size) % (dp * cfg.micro_batch_size) == 0
    assert layout.gpus_per_node % vtp == 0 and layout.world_size % vtp == 0 and tp % vtp == 0
    # Qwen3.5: packed delta-net layers need whole sequences on each TP rank (recipes/qwen35.py)
    assert cfg.model.sequence_parallel == (tp > 1 and (not spec.is_hybrid or cfg.packing == "padded"))
    assert cfg.model.recompute_granularity == layout.recompute_granularity
    # the packing budget is one CP rank's share of the longest sequence, the estimate's tokens
    longest = cfg.data.max_prompt_len + cfg.rollout.max_response_len
    assert longest == layout.seq_len and cfg.packing == paper.QWEN35_PACKING.get(size, "budget")
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
    """CP makes room for every layer's activations (no recomputation) at 8B and 14B,
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


def test_30b_a3b_measures_routing_every_tenth_step():
    # one more no-grad forward over the step's samples: a diagnostic, not every step at scale
    assert paper.paper_recipe("qwen3_30b_a3b").rollout.routing_every == paper.ROUTING_EVERY == 10


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


def test_docs_memory_table_is_current():
    """docs/recipes.md's memory table is what `scripts/memory_table.py` writes from `memory_estimate`
    (run `python scripts/memory_table.py` after changing a layout or the memory model)."""
    import importlib.util
    import os

    root = REPO_DIR
    spec = importlib.util.spec_from_file_location("memory_table", os.path.join(root, "scripts", "memory_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(os.path.join(root, "docs", "recipes.md"), encoding="utf-8") as f:
        assert module.block() in f.read(), "docs/recipes.md's memory table is stale: run python scripts/memory_table.py"


def test_partial_rollouts_on_the_8b_async_layout_are_refused_at_build_time_naming_the_fields():
    """The 8B async layout (CP = 2; DP 2 trainer replicas against 4 engines) cannot run partial
    rollouts: building the config names both reasons, before any process starts."""
    partial = {"mode": "partial", "partial": {"oversample": 1.5}}
    with pytest.raises(ValueError) as info:
        build_config("qwen3_8b_async", check_paths=False, rollout=partial)
    message = str(info.value)
    assert "rollout.mode='partial' is not supported with model.context_parallel_size=2" in message, message
    assert ("rollout.mode='partial' needs at least as many trainer replicas (DP 2) as engines (rollout.separate.engine_ranks=16 "
            "/ rollout.tensor_parallel_size=4 = 4)") in message, message
    # without CP the 16 training ranks are DP 4 replicas, one per engine: it builds
    no_cp = {"context_parallel_size": 1, "recompute_granularity": "full", "recompute_method": "uniform",
             "recompute_num_layers": 1}
    cfg, _ = build_config("qwen3_8b_async", check_paths=False, rollout=partial, model=no_cp,
                          max_tokens_per_microbatch=16384)
    assert cfg.rollout.mode == "partial" and cfg.rollout.partial.oversample == 1.5 and cfg.rollout.num_engines == 4
    # engines of vLLM TP 2: 8 engines for 4 replicas
    with pytest.raises(ValueError, match=r"rollout\.mode='partial' needs at least as many trainer replicas \(DP 4\) as "
                                         r"engines \(rollout\.separate\.engine_ranks=16 / rollout\.tensor_parallel_size=2 = 8\)"):
        build_config("qwen3_8b_async", check_paths=False, rollout={**partial, "tensor_parallel_size": 2},
                     model=no_cp, max_tokens_per_microbatch=16384)


def test_the_async_recipe_corrects_for_the_behaviour_policy_and_the_synchronous_ones_do_not():
    assert paper.paper_recipe("qwen3_8b_async").loss.rollout_correction.mode == paper.ASYNC_CORRECTION == "tis"
    for size in SIZES:
        if not paper.LAYOUTS[size].engine_ranks:
            assert paper.paper_recipe(size).loss.rollout_correction.mode == "none"  # the paper's setting
    # a method switch keeps the correction (the method changes the loss's mask, not the sampling)
    assert paper.paper_recipe("qwen3_8b_async", "grpo").loss.rollout_correction.mode == "tis"


def test_the_streaming_recipe_builds_and_a_layout_that_cannot_stream_is_refused_naming_the_fields():
    cfg, _ = build_config("qwen3_8b_stream", check_paths=False)
    r = cfg.rollout
    assert (r.mode, r.separate.max_staleness, r.tensor_parallel_size, r.num_engines) == ("streaming",
                                                                                         paper.STREAM_STALENESS, 1, 24)
    assert r.streaming.reserve_tokens == paper.STREAM_RESERVE_TOKENS < r.max_response_len
    assert cfg.loss.rollout_correction.mode == paper.ASYNC_CORRECTION
    # tau_H from the pi_old pass (exact for the first of 256 / 64 = 4 mini-batches), every layer's activations kept
    assert (cfg.loss.tau_h_source, paper.STREAM_TAU_H_SOURCE, paper.STREAM_STALENESS) == ("old", "old", 3)
    assert (cfg.model.recompute_granularity, cfg.prompts_per_step // cfg.minibatch_prompts) == (None, 4)
    assert paper.paper_recipe("qwen3_8b_async").loss.tau_h_source == "exact" == paper.PAPER_LOSS["tau_h_source"]
    layout = paper.layout_for("qwen3_8b_stream", cfg)
    assert memory.memory_estimate(paper.ARCHITECTURES["qwen3_8b_stream"], layout).total / memory.GB == \
        pytest.approx(65.5, abs=0.05)
    # the one-step-off layout (CP = 2, vLLM TP = 4) cannot stream: both named
    with pytest.raises(ValueError, match=r"rollout\.mode='streaming' needs rollout\.tensor_parallel_size=1, got 4"):
        build_config("qwen3_8b_async", check_paths=False, rollout={"mode": "streaming", "separate.max_staleness": 2})
    with pytest.raises(ValueError, match=r"rollout\.mode='streaming' is not supported with model\.context_parallel_size=2"):
        build_config("qwen3_8b_async", check_paths=False,
                     rollout={"mode": "streaming", "separate.max_staleness": 2, "tensor_parallel_size": 1})
    with pytest.raises(ValueError, match=r"rollout\.mode='streaming' needs rollout\.separate\.max_staleness >= 1"):
        build_config("qwen3_8b_stream", check_paths=False, rollout={"separate.max_staleness": 0})
