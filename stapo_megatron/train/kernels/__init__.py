"""Triton kernels behind ``stapo_megatron.train.ops`` (imported only when a Triton path is chosen)."""
