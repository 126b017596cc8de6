"""HF Qwen <-> Megatron checkpoint conversion (the `stapo-convert` CLI); see conversion/cli.py."""
