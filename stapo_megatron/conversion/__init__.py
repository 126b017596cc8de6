"""HF Qwen <-> Megatron checkpoint conversion (the `stapo-convert` CLI); see stapo_megatron/conversion/cli.py."""
