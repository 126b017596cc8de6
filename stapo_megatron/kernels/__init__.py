"""Triton kernels behind ``stapo_megatron.ops`` (imported only when a Triton path is chosen)."""
