"""The embedded default main job without NeMo-Run: plain torchrun, 2 processes, DP=2.

    .venv/bin/torchrun --nproc-per-node 2 examples/demo_rl.py [recipe=tiny] [method=stapo] [output_dir=runs/demo] [key=value ...]

The same job as ``make demo`` (``nemo-run launch/stapo_tiny.py --yes``): the config comes from the
same `launch.entry.run_recipe` with the same overrides (``seed=7``, ``steps=20``, ``loss.tau_p=0.01``),
which also writes the tiny model folder. Writes runs/demo/metrics.jsonl, metrics.png,
silenced_tokens.jsonl, tensorboard/ and checkpoints/ (a rerun resumes).

``recipe=qwen3_14b`` (or qwen3_8b, qwen3_1p7b) runs a paper recipe the same way, e.g. on a cluster
without NeMo-Run (``python -m stapo_megatron.launch.entry RECIPE ...`` is the same entry, and
``nemo-run launch/stapo_14b.py --emit-sbatch job.sh ...`` writes a whole sbatch script for it).
"""

import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from stapo_megatron.launch.entry import RECIPES, parse_arguments, run_recipe  # noqa: E402

if __name__ == "__main__":
    try:
        arguments = parse_arguments(sys.argv[1:])
    except ValueError as e:
        raise SystemExit(str(e))
    recipe = arguments.pop("recipe", "tiny")
    if recipe not in RECIPES:
        raise SystemExit(f"recipe must be one of {RECIPES}, got {recipe!r}")
    run_recipe(recipe, **arguments)
