"""What the launch tests share: ``nemo-run`` run from the checkout, the sbatch script a dry run
prints, a paper recipe's config and its save signal and requeue budget, a recipe architecture's
config.json, and the bash line that does to a run folder what a checkpoint save does."""

import json
import os
import re
import subprocess
import sys

from stapo_megatron.recipes import lora, paper
from tests.helpers import REPO_DIR

REPO = REPO_DIR


NEMO_RUN = os.path.join(os.path.dirname(sys.executable), "nemo-run")


def nemo_run(tmp_path, *args, env=None, timeout=300):
    """Run ``nemo-run ARGS`` from the checkout with its own NEMORUN_HOME and no STAPO_* settings."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("STAPO_")}
    # NEMORUN_HOME: experiments and local job states go to tmp; COLUMNS: rich tables unwrapped
    environ.update(NEMORUN_HOME=str(tmp_path / "nemo_run_home"), COLUMNS="250", **(env or {}))
    proc = subprocess.run([NEMO_RUN, *args], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def sbatch_script(output: str) -> str:
    match = re.search(r"^# ---- sbatch script of task .*?\n(#!/bin/bash.*)", output, re.M | re.S)
    assert match, output
    return match.group(1)


def paper_signal_and_retries(size, **overrides):
    """The save signal and requeue budget of a paper recipe's FINAL configuration (its step time)."""
    from stapo_megatron.launch.entry import build_config
    from stapo_megatron.launch.timing import FAILURE_RETRIES
    from stapo_megatron.recipes import paper, step_time

    cfg = build_config(size, check_paths=False, **overrides)[0]
    step = step_time.estimate_step_time(paper.ARCHITECTURES[size], paper.layout_for(size, cfg), cfg)
    signal_s = step_time.signal_seconds(step)
    return signal_s, step_time.jobs_needed(cfg.steps, step, 4 * 3600, signal_s) - 1 + FAILURE_RETRIES


def config(size, **overrides):
    """A paper recipe's final TrainerConfig with ``overrides``, its paths unchecked."""
    from stapo_megatron.launch.entry import build_config

    return build_config(size, check_paths=False, **overrides)[0]


def write_hf_config(folder, size, **changes):
    """A config.json of the recipe's architecture (HF spelling), with ``changes``."""
    spec = paper.ARCHITECTURES[size]
    hf = {"architectures": [spec.architecture], "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
          "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_query_groups,
          "max_position_embeddings": spec.max_position_embeddings}
    if spec.num_moe_experts:
        hf["num_experts"] = spec.num_moe_experts
    hf.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))
    return str(folder)


SAVE = 'mkdir -p "$RUN/checkpoints/step_00000020" && echo step_00000020 > "$RUN/checkpoints/latest"; '
"""What a save does to the run folder (mcore/checkpoint.py's layout)."""


PAPER_FILES = [f"launch/stapo_{name.removeprefix('qwen3_')}.py" for name in sorted([*paper.LAYOUTS, *lora.LAYOUTS])]
"""The launch file of each paper recipe and LoRA recipe (``qwen3_8b_32k`` -> ``launch/stapo_8b_32k.py``)."""
