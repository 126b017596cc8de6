"""Tier a: the paper recipes' torchrun entry without NeMo-Run (``python -m stapo_megatron.launch.entry``,
``examples/demo_rl.py recipe=...``) and its key=value parsing."""

import os
import subprocess
import sys

import pytest

from stapo_megatron.launch.entry import format_arguments, parse_arguments
from tests.helpers import REPO_DIR

REPO = REPO_DIR


def test_arguments_read_back():
    kwargs = {"recipe": "qwen3_14b", "method": "justrl", "output_dir": "/r", "config": None, "steps": 3,
              "model": {"hf_dir": "/m"}, "rollout": {"max_response_len": 8192, "temperature": 0.7},
              "loss": {}, "data": {"eval_prompt_field": "1"}}
    texts = format_arguments(kwargs)
    assert texts == ["method=justrl", "output_dir=/r", "steps=3", "model.hf_dir=/m", "rollout.max_response_len=8192",
                     "rollout.temperature=0.7", "data.eval_prompt_field='1'"]
    assert parse_arguments(texts) == {k: v for k, v in kwargs.items() if k != "recipe" and v}
    # a section's own section (loss.rollout_correction) reads back as a dict of its own; an empty one is left out
    nested = {"loss": {"tau_p": 0.01, "rollout_correction": {"mode": "tis", "tis_cap": 3.0}}, "model": {}}
    texts = format_arguments(nested)
    assert texts == ["loss.tau_p=0.01", "loss.rollout_correction.mode=tis", "loss.rollout_correction.tis_cap=3.0"]
    assert parse_arguments(texts) == {"loss": nested["loss"]}
    assert format_arguments({"loss": {"rollout_correction": {}}, "model": {}}) == []  # a launch task's empty sections
    with pytest.raises(ValueError, match="expected key=value, got 'steps'"):
        parse_arguments(["steps"])


def test_yaml_words_parse_as_nemo_run_and_the_dumped_yaml_write_them():
    """YAML words parse as NeMo-Run parses them: ``model.sequence_parallel=false`` is the bool False,
    not the string "false"."""
    from stapo_megatron.launch.entry import build_config

    arguments = parse_arguments(["model.sequence_parallel=false", "model.bf16=True", "rollout.top_k=-1",
                                 "data.eval_path=null", "loss.method=FALSE"])
    assert arguments == {"model": {"sequence_parallel": False, "bf16": True}, "rollout": {"top_k": -1},
                         "data": {"eval_path": None}, "loss": {"method": False}}
    cfg, _ = build_config("tiny", output_dir="/tmp/unused", **parse_arguments(["model.bf16=false"]))
    assert cfg.model.bf16 is False
    # a string that reads as such a word is quoted, and reads back as the string
    texts = format_arguments({"data": {"prompt_field": "false"}})
    assert texts == ["data.prompt_field='false'"] and parse_arguments(texts) == {"data": {"prompt_field": "false"}}


@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "stapo_megatron.launch.entry", "qwen3_1p7b"],
    [sys.executable, os.path.join(REPO, "examples", "demo_rl.py"), "recipe=qwen3_1p7b"],
])
def test_paper_recipe_runs_through_the_torchrun_entry(tmp_path, command):
    """A paper recipe's config is built and checked on the worker (here: its unset paths, and one
    process is not its layout)."""
    proc = subprocess.run([*command, f"output_dir={tmp_path}/run", "model.hf_dir=/nonexistent/model",
                           "rollout.max_response_len=8192"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "recipe qwen3_1p7b cannot run" in proc.stderr, proc.stderr[-3000:]
    assert "data.train_path is not set" in proc.stderr and "1 GPUs are not divisible by TP 2" in proc.stderr


def test_entry_usage():
    proc = subprocess.run([sys.executable, "-m", "stapo_megatron.launch.entry", "qwen9"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "recipe must be one of ('tiny', 'tiny_moe', 'tiny_lora', 'tiny_qwen35', 'qwen3_1p7b'" in proc.stderr


def _docs_cpu_trial():
    """The "A paper recipe on this CPU" block of docs/launching.md: (its ``CPU`` overrides, its commands)."""
    import re

    with open(os.path.join(REPO, "docs", "launching.md"), encoding="utf-8") as f:
        text = f.read()
    block = re.search(r"<!-- cpu-paper-trial:begin -->\n```bash\n(.*?)```\n<!-- cpu-paper-trial:end -->",
                      text, re.S).group(1)
    overrides = re.search(r'^CPU="(.*?)"$', block, re.S | re.M).group(1).split()
    return overrides, [line for line in block.splitlines() if line and not line.startswith(("CPU=", " "))]


def test_the_docs_cpu_trial_of_a_paper_recipe_is_a_valid_paper_config():
    """The overrides docs/launching.md gives for a paper recipe at DP=2 on the CPU pass the recipe's
    own checks on the 1 x 2 processes of its torchrun command (the layout, the batches over DP, the
    per-rank token budget), keep the recipe's bf16 and distributed optimizer, save every step and
    resume."""
    from stapo_megatron.launch.entry import build_config

    overrides, commands = _docs_cpu_trial()
    runs = [c for c in commands if "-m stapo_megatron.launch.entry" in c]
    assert len(runs) == 2 and all("--nproc-per-node 2" in c and " qwen3_1p7b $CPU output_dir=runs/p1 " in c
                                  for c in runs)
    steps = [parse_arguments(c.split("$CPU ")[1].split())["steps"] for c in runs]
    assert steps == [2, 4]  # the second run resumes from the first one's last checkpoint
    cfg, _ = build_config("qwen3_1p7b", output_dir="runs/p1", num_nodes=1, gpus_per_node=2, steps=2,
                          **parse_arguments(overrides))
    assert (cfg.model.bf16, cfg.optim.use_distributed_optimizer, cfg.save_every) == (True, True, 1)
    assert (cfg.model.tensor_model_parallel_size, cfg.rollout.tensor_parallel_size) == (1, 1)
    assert cfg.data.max_prompt_len + cfg.rollout.max_response_len <= 512  # the tiny model's positions
    assert any(c.startswith("stapo-eval runs/p1 ") for c in commands)


def test_a_layout_the_config_refuses_names_every_problem_of_the_recipe():
    """TP=3 on Qwen3-14B: `TrainerConfig` refuses the token budget TP=3 changes (its first layout
    problem); the recipe's check names the 40 heads and 8 KV heads too, and every other problem."""
    from stapo_megatron.launch.entry import build_config

    with pytest.raises(ValueError) as refused:
        build_config("qwen3_14b", model={"tensor_model_parallel_size": 3})
    problems = str(refused.value).split("\n  - ")
    assert problems[0] == "recipe qwen3_14b cannot run:"
    assert problems[1:3] == ["num_attention_heads 40 is not divisible by tensor_model_parallel_size 3",
                             "num_query_groups 8 is not divisible by tensor_model_parallel_size 3"]
    assert problems[3].startswith("max_tokens_per_microbatch 4096 < the longest sequence")
    assert "64 GPUs are not divisible by TP 3 x PP 1 x CP 4" in problems
    assert "data.train_path is not set (DAPO-Math-17k, parquet or JSONL)" in problems
    # a refusal that is not a layout problem stays the one message
    with pytest.raises(ValueError, match=r"^TrainerConfig.micro_batch_size must be >= 1, got 0$"):
        build_config("qwen3_14b", micro_batch_size=0, model={"tensor_model_parallel_size": 3})
