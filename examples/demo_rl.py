"""The embedded default main job without NeMo-Run: plain torchrun, 2 processes, DP=2.

    .venv/bin/torchrun --nproc-per-node 2 examples/demo_rl.py [method=stapo] [output_dir=runs/demo] [key=value ...]

The same job as ``make demo`` (``nemo-run launch/stapo_tiny.py --yes``): the config comes from the
same `launch.entry.run_recipe` with the same overrides (``seed=7``, ``steps=20``, ``loss.tau_p=0.01``),
which also writes the tiny model folder. Writes runs/demo/metrics.jsonl, metrics.png,
silenced_tokens.jsonl, tensorboard/ and checkpoints/ (a rerun resumes).
"""

import ast
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from stapo_megatron.launch.entry import SECTIONS, run_recipe  # noqa: E402


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


if __name__ == "__main__":
    arguments, sections = {}, {name: {} for name in SECTIONS}
    for arg in sys.argv[1:]:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {arg!r}")
        section, dot, field = key.partition(".")
        if dot and section in sections:
            sections[section][field] = _value(value)
        else:
            arguments[key] = _value(value)
    run_recipe("tiny", **{**sections, **arguments})
