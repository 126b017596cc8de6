"""Write the embedded default's model folder: an offline character tokenizer + a tiny Qwen3.

    .venv/bin/python examples/prepare_tiny_model.py runs/demo/model

The folder is what a real run points at (config.json, safetensors, tokenizer): vLLM starts from
it and the trainer builds its Megatron model from its config. The weights written here are a
placeholder; the trainer syncs its own (warm-started) weights into vLLM before the first rollout.
"""

import sys

from stapo_megatron.recipes.tiny import prepare_tiny_model

if __name__ == "__main__":
    prepare_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "runs/demo/model")
