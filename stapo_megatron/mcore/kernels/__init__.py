"""Triton kernels behind ``stapo_megatron.mcore.ops`` (imported only when a Triton path is chosen)."""
