"""Tier a: the calibrated cost model of a step (`stapo_megatron.recipes.step_model`): the shapes it
reads from a recipe's architecture, the length distribution's moments, one engine's decode model,
the trainer's passes, and the streaming recipe's closed-form step worked out by hand."""

import dataclasses
import math

import pytest

from stapo_megatron.recipes import paper, step_model, step_time

QWEN3_8B = paper.ARCHITECTURES["qwen3_8b_stream"]


def _recipe(name="qwen3_8b_stream"):
    cfg = paper.paper_recipe(name)
    return cfg, paper.layout_for(name, cfg)


def test_the_shapes_of_a_recipes_architecture():
    spec = step_model.model_spec(QWEN3_8B)
    assert spec.params == 8_190_735_360 and spec.active_params is None and spec.expert_params == 0
    assert (spec.num_layers, spec.attn_width, spec.kv_heads) == (36, 4096, 8)
    assert spec.kv_bytes_per_token == 36 * 8 * 128 * 2 * 2 == 147_456
    moe = step_model.model_spec(paper.ARCHITECTURES["qwen3_30b_a3b"])
    assert moe.params == pytest.approx(30.5e9, rel=0.01) and moe.active_params == pytest.approx(3.35e9, rel=0.01)
    assert moe.expert_params == 48 * 128 * 3 * 2048 * 768 and moe.expert_share == 8 / 128


def test_one_h100_engine_of_the_8b():
    # weights 16.38 GB at 3.35 TB/s x 1/1.16, plus the fitted 5.51 ms; KV of 0.85 x 80 GB less the weights
    dm = step_model.decode_model(step_model.model_spec(QWEN3_8B), step_model.H100, step_model.Efficiency(), 1, 0.85)
    assert dm.weight_s == pytest.approx(2 * 8.1907e9 / (3.35e12 / 1.16) + 5.51e-3, rel=1e-4)
    assert dm.kv_capacity_tokens == int((0.85 * 80 - 2 * 8_190_735_360 / 1e9) * 1e9 / 147_456) == 350_060
    assert dm.time(1000.0, 2, 3) == pytest.approx(3 * (dm.weight_s + 2 * dm.seq_s) + dm.kv_s_per_token * (3000 + 6))
    with pytest.raises(ValueError, match="no KV cache"):
        step_model.decode_model(step_model.model_spec(QWEN3_8B), step_model.H100, step_model.Efficiency(), 1, 0.2)


def test_the_trainers_passes():
    spec, hw, eff = step_model.model_spec(QWEN3_8B), step_model.H100, step_model.Efficiency()
    tokens = [4000] * 64
    forward = step_model.train_phase_s(spec, hw, eff, tokens, 8, "forward")
    update = step_model.train_phase_s(spec, hw, eff, tokens, 8, "update")
    # two forward passes (pi_old, the exact tau_H pass); recompute adds a forward to the update's three
    assert step_model.trainer_s(spec, hw, eff, tokens, 8, forwards=2) == pytest.approx((2 * forward, update))
    assert step_model.trainer_s(spec, hw, eff, tokens, 8, 2, recompute=True)[1] == pytest.approx(update * 4 / 3)
    with pytest.raises(ValueError, match="forwards"):
        step_model.trainer_s(spec, hw, eff, tokens, 8, forwards=-1)
    with pytest.raises(ValueError, match="phase"):
        step_model.train_phase_s(spec, hw, eff, tokens, 8, "backward")


def test_the_recipes_jobs():
    cfg, layout = _recipe()
    job = step_model.recipe_job(QWEN3_8B, layout, cfg)
    assert (job.engine_gpus, job.engine_tp, job.memory_share, job.trainer_gpus, job.trainer_replica_gpus) == \
        (24, 1, 0.85, 8, 4)
    assert (job.forwards, job.recompute, job.reserve_tokens, job.prompts_per_step, job.group) == \
        (1, False, 4096, 256, 8)
    assert (job.colocated, job.streaming, job.max_staleness) == (False, True, 3)
    assert job.kv_reserve == pytest.approx((562 + 4096) / (562 + 4221.8), rel=1e-4)
    with pytest.raises(ValueError, match="engine_gpus"):
        step_model.streaming_step(dataclasses.replace(job, engine_tp=32))
    cfg, layout = _recipe("qwen3_8b")  # colocated, CP=2 without recompute
    job = step_model.recipe_job(paper.ARCHITECTURES["qwen3_8b"], layout, cfg)
    assert (job.colocated, job.streaming, job.engine_gpus, job.trainer_gpus, job.trainer_replica_gpus) == \
        (True, False, 32, 32, 8)
    assert (job.engine_tp, job.memory_share, job.forwards, job.recompute) == (4, 0.4, 2, False)
    grpo = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, kl_coef=0.04, tau_h_source="old"))
    assert step_model.recipe_forwards(grpo) == 2  # pi_old and the reference


def test_a_step_generated_at_once_waits_for_its_tail():
    # 1 prompt x 4 samples on 2 engines of a toy decode model (1 s an iteration, no KV cost): the
    # responses at the quantiles 1/8, 3/8, 5/8, 7/8 of a log-normal of median 100, sigma 1 are
    # 31, 72, 137 and 196 capped at 150; dealt from the longest, engine 0 runs 150 and 72 and
    # ends after 150 iterations, engine 1 (137, 31) after 137
    lengths = step_model.Lengths((10, 10), response_median=100, response_sigma=1.0, response_cap=150)
    assert lengths.quantile_responses(4) == [31, 72, 137, 150]
    toy = step_model.ModelSpec("toy", params=1e9, num_layers=1, attn_width=1, kv_heads=1)
    eff = step_model.Efficiency(iteration_overhead_s=1.0, decode_mfu=1e9, prefill_mfu=1e9, hbm_efficiency=1e9)
    job = step_model.RecipeJob(toy, step_model.H100, lengths, 1, 4, engine_gpus=2, engine_tp=1, memory_share=0.5,
                               trainer_gpus=2, trainer_replica_gpus=1, forwards=1, recompute=False, colocated=True,
                               eff=eff)
    assert step_model.generation_s(job) == pytest.approx(150.0, rel=1e-6)
    rollout, training, overlapped = step_model.estimate(job)
    assert rollout == pytest.approx(150.0 + 2.0 + 2 / 50, rel=1e-6) and not overlapped  # + sleep, wake, reload
    assert training == pytest.approx(step_model.training_s(job))


def test_the_streaming_step_by_hand():
    cfg, layout = _recipe()
    rollout_s, training_s = step_model.streaming_step(step_model.recipe_job(QWEN3_8B, layout, cfg))
    # running samples: 350,060 / (562 + 4,096) - 8 / 2 = 71.15 (the cache at the running samples'
    # mean context 562 + E[L^2] / 2E[L] = 4,258.6 would hold 82.2); an iteration 11.18 ms + 71.15 x
    # 4,258.6 x 51.06 ns of KV + 71.15 x 35.77 us = 29.20 ms; 2,048 x 4,221.8 / (24 x 71.15) =
    # 5,063 iterations: 147.85 s, + prefill 2,048 x 562 / 24 x 33.13 us = 1.59 s + the load 0.655 s
    running = 350_060 / 4658 - 4
    iteration = 0.0111824 + running * 4258.6 * 5.10594e-8 + running * 3.57747e-5
    assert rollout_s == pytest.approx(2048 * 4221.8 / (24 * running) * iteration + 1.5888 + 0.65526, rel=1e-3)
    assert rollout_s == pytest.approx(150.09, abs=0.05)
    assert training_s == pytest.approx(146.05, abs=0.05)
    # the trainer's pi_old pass (tau_H from it) and its update without recompute, 9.8M tokens on 8
    # GPUs, and the send
    spec, eff = step_model.model_spec(QWEN3_8B), step_model.Efficiency()
    tokens = [562 + r for r in step_model.PAPER_LENGTHS.quantile_responses(2048)]
    assert training_s == pytest.approx(sum(step_model.trainer_s(spec, step_model.H100, eff, tokens, 8, 1, False))
                                       + 2 * 8.1907e9 / 25e9, rel=1e-6)
    # with the exact tau_H pass and full recompute (the recipe's trainer before) the trainers set the pace
    full = dataclasses.replace(cfg.model, recompute_granularity="full", recompute_method="uniform",
                               recompute_num_layers=1)
    exact = dataclasses.replace(cfg, model=full, loss=dataclasses.replace(cfg.loss, tau_h_source="exact"))
    exact = step_model.recipe_job(QWEN3_8B, layout, exact)
    assert step_model.streaming_step(exact)[1] == pytest.approx(230.31, abs=0.05)


def test_the_dry_run_estimates_with_this_model():
    cfg, layout = _recipe()
    step = step_time.estimate_step_time(QWEN3_8B, layout, cfg)
    assert (step.rollout_s, step.training_s) == step_model.streaming_step(step_model.recipe_job(QWEN3_8B, layout, cfg))
    assert step.overlapped and step.total_s == step.rollout_s > step.training_s  # the engines set the pace
    assert math.isclose(step.total_s / 60, 2.50, abs_tol=0.01)
    cfg, layout = _recipe("qwen3_8b")
    step = step_time.estimate_step_time(paper.ARCHITECTURES["qwen3_8b"], layout, cfg)
    job = step_model.recipe_job(paper.ARCHITECTURES["qwen3_8b"], layout, cfg)
    assert (step.rollout_s, step.training_s, step.overlapped) == step_model.estimate(job)
    assert step.total_s == step.rollout_s + step.training_s and 240 < step.total_s < 280


def test_lora_passes_by_hand():
    """LoRA: the frozen base's backward computes input gradients only (2N, not 4N), the adapters
    cost 2 FLOPs per parameter and token in every pass (6 in the update, 8 with recompute);
    attention is unchanged. A toy model: N = 1e9, adapters 1e7, 10 layers of width 1000, eight
    sequences of 1000 tokens on 8 GPUs (1000 tokens a GPU)."""
    toy = step_model.ModelSpec("toy", params=1e9, num_layers=10, attn_width=1000, kv_heads=8)
    lora = dataclasses.replace(toy, adapter_params=1e7)
    hw, eff, tokens = step_model.H100, step_model.Efficiency(), [1000] * 8
    attention = 4 * 10 * 1000 * 8 * 1000 ** 2 / 2  # 1.6e11 a pass
    base, adapters = 2 * 1e9 * 8000, 2 * 1e7 * 8000  # 1.6e13, 1.6e11 a pass

    def seconds(flops, mfu_max):
        return flops / (8 * 989e12 * mfu_max * 1000 / (1000 + eff.half_tokens))

    update = step_model.train_phase_s(lora, hw, eff, tokens, 8, "update")
    assert update == pytest.approx(seconds(2 * base + 3 * (adapters + attention), eff.update_mfu), rel=1e-12)
    assert update == pytest.approx(seconds(3.296e13, eff.update_mfu), rel=1e-12)  # against full: 4.848e13
    assert step_model.train_phase_s(toy, hw, eff, tokens, 8, "update") == \
        pytest.approx(seconds(4.848e13, eff.update_mfu), rel=1e-12)
    assert step_model.train_phase_s(lora, hw, eff, tokens, 8, "update", recompute=True) == \
        pytest.approx(seconds(3 * base + 4 * (adapters + attention), eff.update_mfu), rel=1e-12)
    assert step_model.train_phase_s(lora, hw, eff, tokens, 8, "forward") == \
        pytest.approx(seconds(1.632e13, eff.forward_mfu), rel=1e-12)
    # merge-on-sync reloads the bf16 model (2 GB); the adapter-only sync the fp32 adapters (40 MB)
    assert step_model.switch_s(lora, eff, colocated=False) == pytest.approx(2.0 / eff.transfer_gb_per_s)
    only = dataclasses.replace(lora, adapter_sync=True)
    assert step_model.switch_s(only, eff, colocated=False) == pytest.approx(0.04 / eff.transfer_gb_per_s)


def test_a_lora_recipes_job_counts_its_adapters():
    """The job of a LoRA recipe counts the whole model's adapters (Qwen3-8B, r = 16, all four
    targets: 16 x (4096 + 6144 + 8192 + 4096 + 24576 + 12288 + 4096) x 36 layers), the reference
    pass of a KL term stays (the base with its adapters off), and the step trains faster."""
    from stapo_megatron.mcore.lora_config import LoraConfig

    cfg = paper.paper_recipe("qwen3_8b")
    lora_cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=16))
    full = step_model.recipe_job(paper.ARCHITECTURES["qwen3_8b"], paper.layout_for("qwen3_8b", cfg), cfg)
    job = step_model.recipe_job(paper.ARCHITECTURES["qwen3_8b"], paper.layout_for("qwen3_8b", lora_cfg), lora_cfg)
    assert (full.model.adapter_params, job.model.adapter_params) == (0.0, 16 * 63488 * 36)
    assert not job.model.adapter_sync and job.forwards == full.forwards == 2
    (full_fwd, full_update), (fwd, update) = (
        step_model.trainer_s(j.model, j.hardware, j.eff, step_model._tokens(j), j.trainer_gpus, j.forwards, j.recompute)
        for j in (full, job))
    # the forwards gain the adapters' 2 x 36.6M against 2 x 8.2B FLOPs a token (0.4%, and attention)
    assert fwd == pytest.approx(full_fwd * (1 + 36569088 / 8190735360), rel=1e-3) and fwd > full_fwd
    # the update loses one of its three base passes; attention (16k-token sequences) stays
    assert 2 / 3 < update / full_update < 0.75
    grpo = dataclasses.replace(lora_cfg, loss=dataclasses.replace(cfg.loss, kl_coef=0.04))
    assert step_model.recipe_forwards(grpo) == 3  # pi_old, tau_H and the reference (base) pass
