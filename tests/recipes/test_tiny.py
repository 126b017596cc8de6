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
