"""Tier a: the tiny recipe is the demo's configuration, and its model preparation refuses a folder
it did not make."""

import pytest

from stapo_megatron.launch.entry import build_config
from stapo_megatron.recipes.tiny import tiny_demo


def test_tiny_recipe_is_the_demo():
    assert build_config("tiny") == tiny_demo(run_dir="runs/demo", method="stapo")


def test_prepare_tiny_model_refuses_a_foreign_folder(tmp_path):
    from stapo_megatron.recipes.tiny import prepare_tiny_model

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="no config.json"):
        prepare_tiny_model(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert not list(tmp_path.parent.glob(f"{tmp_path.name}.tmp-*")), "no temporary folder left behind"


def test_the_lora_demo_is_the_demos_rl_on_its_warm_started_base():
    """``tiny_lora_demo``: the demo's RL (same steps, batch, sampling, loss, data and seed) with
    the ``lora`` defaults at 10x the demo's learning rate, from the full demo's warm-started
    weights (``make demo-lora`` writes them beside the run) and no warm-start of its own."""
    import dataclasses
    import os

    from stapo_megatron.recipes.tiny import LORA_LR, tiny_lora_demo

    full, _ = tiny_demo(run_dir="runs/demo-lora")
    cfg, warmstart = build_config("tiny_lora")
    assert warmstart is None and (cfg, warmstart) == tiny_lora_demo(run_dir="runs/demo-lora")
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.optim.lr) == (16, 32.0, LORA_LR) and LORA_LR == 10 * full.optim.lr
    assert cfg.model.megatron_ckpt == os.path.abspath("runs/demo-lora-base/warm-start")
    assert cfg.model.hf_dir == full.model.hf_dir == "runs/demo-lora/model"
    assert dataclasses.replace(cfg.model, megatron_ckpt=full.model.megatron_ckpt) == full.model
    assert dataclasses.replace(cfg, lora=None, optim=full.optim, model=full.model) == full


def test_tiny_qwen35_recipe_is_the_demo_on_a_hybrid_model():
    """``tiny_qwen35_demo``: the demo's task with ``QWEN35_OVERRIDES`` (HF-engine rollouts) and a
    shorter warm-start, on a model the bridge reads as Qwen3.5 (delta-net layers 0-2, gated full
    attention at 3, partial RoPE)."""
    import dataclasses

    from stapo_megatron.bridge import spec_from_hf_config
    from stapo_megatron.recipes.tiny import (QWEN35_OVERRIDES, QWEN35_WARMSTART_STEPS, tiny_qwen35_config,
                                             tiny_qwen35_demo)

    cfg, warmstart = tiny_qwen35_demo(run_dir="runs/q")
    demo, demo_warmstart = tiny_demo(run_dir="runs/q")
    assert cfg.rollout.engine == "hf" and cfg.steps == QWEN35_OVERRIDES["steps"]
    assert warmstart == dataclasses.replace(demo_warmstart, steps=QWEN35_WARMSTART_STEPS)
    assert dataclasses.replace(cfg, steps=demo.steps, eval=demo.eval, save_every=demo.save_every,
                               rollout=demo.rollout) == demo
    config = tiny_qwen35_config(100, 1, 0)
    spec = spec_from_hf_config({**config.to_dict(), "architectures": config.architectures})
    assert config.architectures == ["Qwen3_5ForCausalLM"] and spec.vocab_size == 100
    assert spec.layers_of_type("linear_attention") == (0, 1, 2) and spec.layers_of_type("full_attention") == (3,)
