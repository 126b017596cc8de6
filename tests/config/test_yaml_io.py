"""Tier a: a run's config.yaml round-trips the configs it was written from, and is checked on
reading as overrides are."""

import dataclasses
import re

import pytest

from stapo_megatron.config.yaml_io import dump_config, load_config, parse_config, write_config
from stapo_megatron.recipes.paper import paper_recipe
from stapo_megatron.recipes.tiny import tiny_demo


@pytest.mark.parametrize("make", [lambda: tiny_demo(method="random"),
                                  lambda: (paper_recipe("qwen3_8b", "grpo", run_dir="/abs/run"), None)])
def test_config_yaml_round_trip(tmp_path, make):
    cfg, warmstart = make()
    path = write_config(str(tmp_path / "c.yaml"), cfg, warmstart, "tiny")
    recipe, again, warmstart_again = load_config(path)
    assert recipe == "tiny" and warmstart_again == warmstart
    # YAML has no tuples: compare what the files say, field for field
    assert dump_config(again, warmstart_again, "tiny") == open(path).read()
    assert dataclasses.replace(again, data=cfg.data) == cfg


def test_config_yaml_is_checked_like_overrides():
    text = dump_config(*tiny_demo(), "tiny")
    with pytest.raises(ValueError, match=r"<config>: unknown override loss.tau_pp: .*did you mean 'tau_p'"):
        parse_config(text.replace("    tau_p:", "    tau_pp:"))
    with pytest.raises(ValueError, match=r"override steps='ten': expected int"):
        parse_config(re.sub(r"^  steps: \d+$", "  steps: ten", text, count=1, flags=re.M))
    with pytest.raises(ValueError, match="unknown top-level key"):
        parse_config(text + "extra: 1\n")
    with pytest.raises(ValueError, match="expected a mapping with a 'trainer' section"):
        parse_config("- 1\n")
