"""What torch's RMSNorm and Megatron's SwiGLU keep for their backward on this device, in bytes per
token and unit of width beyond their input (`stapo_megatron.recipes.memory.kept_layer_bytes`
counts the norm's fp32 copies, 8 per hidden unit, and the fused SwiGLU's input alone).

    python3 benchmarks/saved_bytes.py --device cuda     # the memory model's per-layer terms, checked
    .venv/bin/python benchmarks/saved_bytes.py          # the CPU (unfused SwiGLU)
"""

from __future__ import annotations

import argparse

import torch


def saved_beyond_input(fn, x: torch.Tensor) -> tuple[float, list]:
    """(bytes per row and unit of x's last dimension that ``fn(x)`` saves beyond x, the saved shapes)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                if t.dim() == x.dim() and t.shape[0] == x.shape[0]}  # views of one storage count once
    storages.pop(x.untyped_storage().data_ptr(), None)
    return sum(storages.values()) / x.numel(), [(tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in saved]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    dev, bf16 = args.device, torch.bfloat16
    norm = torch.nn.RMSNorm(2048, eps=1e-6, device=dev, dtype=bf16)
    x = torch.randn(args.tokens, 2048, device=dev, dtype=bf16, requires_grad=True)
    per, shapes = saved_beyond_input(norm, x)
    print(f"{dev}: torch RMSNorm keeps {per:.1f} bytes per token and hidden unit beyond its input: {shapes}")
    gate_up = torch.randn(args.tokens, 2 * 6144, device=dev, dtype=bf16, requires_grad=True)
    try:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        per, shapes = saved_beyond_input(lambda t: bias_swiglu_impl(t, None), gate_up)
        print(f"{dev}: Megatron's fused SwiGLU keeps {per:.1f} bytes per token and unit of 2 ffn beyond its input: "
              f"{shapes}")
    except Exception as error:  # no Triton / torch.compile on this device: the unfused path is what runs
        print(f"{dev}: fused SwiGLU unavailable ({type(error).__name__}: {error})")
    per, shapes = saved_beyond_input(lambda t: torch.nn.functional.silu(t.chunk(2, -1)[0]) * t.chunk(2, -1)[1], gate_up)
    print(f"{dev}: unfused SwiGLU keeps {per:.1f} bytes per token and unit of 2 ffn beyond its input: {shapes}")


if __name__ == "__main__":
    main()
