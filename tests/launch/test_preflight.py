"""The model checks `nemo-run` runs before a submission (`stapo_megatron.launch.preflight`): a
model folder that is not the recipe's, sequences longer than its positions. Real configs
(`entry.build_config`). (Paths no container mount holds: test_paths.py; the save signal / requeue
budget of the final configuration: test_timing.py.)"""

import pytest

pytest.importorskip("nemo_run")

from stapo_megatron.launch import preflight  # noqa: E402
from stapo_megatron.recipes import paper  # noqa: E402
from tests.helpers.launch_cli import config, write_hf_config  # noqa: E402


def test_the_recipes_own_folder_passes(tmp_path):
    for size in paper.ARCHITECTURES:
        assert preflight.model_problems(size, config(size), write_hf_config(tmp_path / size, size)) == []


def test_a_dense_folder_for_the_moe_recipe_is_named(tmp_path):
    folder = write_hf_config(tmp_path / "dense", "qwen3_8b")
    problems = preflight.model_problems("qwen3_30b_a3b", config("qwen3_30b_a3b"), folder)
    assert ("has architectures='Qwen3ForCausalLM', but recipe qwen3_30b_a3b trains Qwen3-30B-A3B-Base "
            "(architectures='Qwen3MoeForCausalLM')") in problems[0]
    assert any("num_experts=None" in p and "(num_experts=128)" in p for p in problems), problems


def test_an_8b_folder_for_the_14b_recipe_names_every_difference(tmp_path):
    folder = write_hf_config(tmp_path / "8b", "qwen3_8b")
    problems = preflight.model_problems("qwen3_14b", config("qwen3_14b"), folder)
    assert len(problems) == 3, problems  # layers, width, heads (8 KV heads in both)
    assert "has num_hidden_layers=36, but recipe qwen3_14b trains Qwen3-14B-Base (num_hidden_layers=40)" in problems[0]
    assert "hidden_size=4096" in problems[1] and "num_attention_heads=32" in problems[2]


def test_sequences_longer_than_the_folders_positions_are_named(tmp_path):
    folder = write_hf_config(tmp_path / "short", "qwen3_8b", max_position_embeddings=16000)
    cfg = config("qwen3_8b", model={"hf_dir": folder})
    prompt, response = cfg.data.max_prompt_len, cfg.rollout.max_response_len
    problems = preflight.model_problems("qwen3_8b", cfg, folder)
    evaluation = paper.EVAL_MAX_RESPONSE_LEN
    assert problems == [
        f"data.max_prompt_len + rollout.max_response_len = {prompt} + {response} = {prompt + response} tokens "
        f"exceed max_position_embeddings=16000 of model.hf_dir {folder!r}",
        f"data.max_prompt_len + the evaluation's response limit = {prompt} + {evaluation} = {prompt + evaluation} "
        f"tokens exceed max_position_embeddings=16000 of model.hf_dir {folder!r}",
    ]
    # exactly the positions: fits
    write_hf_config(tmp_path / "short", "qwen3_8b", max_position_embeddings=prompt + evaluation)
    assert preflight.model_problems("qwen3_8b", cfg, folder) == []
    assert preflight.model_problems("qwen3_8b", cfg, str(tmp_path)) == [
        f"model.hf_dir {folder!r} has no config.json: give the folder of a Hugging Face checkpoint"]
