"""Tier a: the one layout validator (``config/parallel_layout.py``): the
config tree, the trainer's world-size check and the recipes ask it, and a recipe's `ParallelLayout` is
derived from its `ModelConfig` and cluster (nothing copied between them)."""

import dataclasses
import re
import subprocess
import sys

import pytest

from stapo_megatron.config import TrainerConfig
from stapo_megatron.mcore.config import ModelConfig
from stapo_megatron.rollout.config import RolloutSampling
from stapo_megatron.config import parallel_layout
from stapo_megatron.recipes import memory, paper


def test_the_validator_imports_no_torch():
    """It loads on its own with the batch layout's alignments (the config tree may import it
    without torch)."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('l', sys.argv[1]); "
            "module = sys.modules['l'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'stapo_megatron')))")
    out = subprocess.run([sys.executable, "-c", code, parallel_layout.__file__], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "['stapo_megatron', 'stapo_megatron.batch', 'stapo_megatron.batch.alignment']"


def _cfg(**changes):
    model = changes.pop("model", {})
    fields = {**dict(prompts_per_step=8, minibatch_prompts=4, packing="fixed"), **changes}
    return TrainerConfig(model=ModelConfig(**model), rollout=RolloutSampling(group_size=4), **fields)


def test_world_problems_name_every_field_and_value():
    """What the trainer checks once its group has formed (`trainer.replicas.init_groups`)."""
    assert parallel_layout.world_problems(_cfg(model=dict(context_parallel_size=2)), 4) == []
    cfg = _cfg(model=dict(tensor_model_parallel_size=2, context_parallel_size=2))
    assert parallel_layout.world_problems(cfg, 6) == [
        "6 GPUs are not divisible by TP 2 x PP 1 x CP 2"]
    assert parallel_layout.world_problems(_cfg(prompts_per_step=10, model=dict(context_parallel_size=2)), 16) == [
        "prompts_per_step 10 is not divisible by minibatch_prompts 4",
        "minibatch_prompts 4 is not divisible by DP 8"]
    assert parallel_layout.world_problems(_cfg(prompts_per_step=6, minibatch_prompts=6, model=dict(context_parallel_size=2)),
                                 4) == ["prompts_per_step 6 / DP 2 = 3 prompts per replica must be a multiple of "
                                        "model.context_parallel_size 2 (its CP ranks share the sampling)"]
    # whole micro-batches: the recipes' check (4 prompts x 4 samples over DP 2 = 8 per rank, not 3s)
    cfg = _cfg(micro_batch_size=3)
    assert parallel_layout.world_problems(cfg, 2) == []
    assert parallel_layout.world_problems(cfg, 2, whole_micro_batches=True) == [
        "16 sequences per mini-batch are not divisible by DP 2 x micro_batch_size 3"]
    assert parallel_layout.world_problems(_cfg(model=dict(tensor_model_parallel_size=4)), 8, gpus_per_node=2) == [
        "TP 4 must divide the 2 GPUs of a node"]


def test_the_config_tree_raises_the_validators_first_problem():
    cfg = _cfg()
    assert parallel_layout.config_problems(cfg) == []
    cfg.packing, cfg.max_tokens_per_microbatch, cfg.rollout.tensor_parallel_size = "budget", 0, 2  # after construction
    problems = parallel_layout.config_problems(cfg)
    assert problems == ["max_tokens_per_microbatch must be > 0 with packing='budget', got 0",
                        "vLLM TP 2 must divide Megatron TP 1 (rollout.tensor_parallel_size=2, "
                        "model.tensor_model_parallel_size=1): a vLLM engine must not span two DP ranks"]
    with pytest.raises(ValueError, match=re.escape(problems[0]) + "$"):
        dataclasses.replace(cfg)  # __post_init__ again


@pytest.mark.parametrize("size", sorted(paper.LAYOUTS))
def test_a_recipe_layout_is_derived_from_its_model_config(size):
    """The recipe trains with its layout's `ModelConfig` (every parallel and memory field), and the
    layout derived back from the recipe (`ParallelLayout.of`) is the recipe's: the same estimate."""
    recipe_layout, cfg = paper.LAYOUTS[size], paper.paper_recipe(size)
    assert cfg.model == recipe_layout.model and cfg.model is not recipe_layout.model
    derived = paper.layout_for(size, cfg)
    assert derived.model is cfg.model and derived.cluster == recipe_layout.cluster
    for name in memory.MODEL_FIELDS:
        assert getattr(derived, name) == getattr(cfg.model, name)
    assert memory.memory_estimate(paper.ARCHITECTURES[size], derived) == memory.memory_estimate(
        paper.ARCHITECTURES[size], recipe_layout)
    changed = recipe_layout.replace(context_parallel_size=1, num_nodes=1)
    assert (changed.context_parallel_size, changed.num_nodes, recipe_layout.context_parallel_size) == (
        1, 1, cfg.model.context_parallel_size)
