"""HF Qwen <-> Megatron checkpoint conversion (the `stapo-convert` CLI); see stapo_megatron/conversion/cli.py.

Dense and Qwen3-MoE checkpoints: expert tensors are streamed one (layer, expert) slice at a time
into the (layer, global expert) stacked keys megatron-core shards, so they reshard across EP.
"""
