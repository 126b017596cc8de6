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
