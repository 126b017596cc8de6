"""Tier a: the Triton kernels themselves without a GPU: compiled for one (no launch), the "lane"
forward's loop as the module docstring describes it (one exp2 an entry, log2(e) folded into 1 / T,
no block-wide reduction inside the loop), and their launch shapes per device."""

from __future__ import annotations

import os

import pytest


@pytest.mark.parametrize("flags", [False, True])
def test_kernels_compile_for_h100_with_vector_loads(flags):
    """Compile for sm_90 here (no GPU needed): catches what the interpreter accepts and a GPU would not
    (e.g. non-constexpr globals), and checks 16-byte loads when only the real vocabulary is ragged."""
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip("ASTSource attrs format of triton >= 3.4")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this session runs Triton interpreted")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from stapo_megatron.ops import triton_kernels as kernels

    # What Triton infers at launch for aligned pointers and row lengths that are multiples of 16;
    # num_real is left ragged, as on the last TP rank of a padded vocabulary. ``flags`` sets every
    # constexpr switch (FINALIZE / ENTROPY_GRAD and HAS_PADDING) at once.
    common = dict(logits_ptr="*bf16", row_stride="i32", target_ptr="*i64")
    stats_sig = dict(common, out0_ptr="*fp32", out1_ptr="*fp32", out2_ptr="*fp32", out3_ptr="*fp32",
                     out4_ptr="*fp32",
                     vocab_local="i32", num_real="i32", vocab_start="i32", inv_temp="fp32",
                     log2e_inv_temp="fp32", FINALIZE="constexpr", HAS_PADDING="constexpr", BLOCK_V="constexpr")
    grad_sig = dict(logits_ptr="*bf16", row_stride="i32", grad_ptr="*bf16", grad_row_stride="i32",
                    target_ptr="*i64", log_z_ptr="*fp32", g_logprob_ptr="*fp32", entropy_ptr="*fp32",
                    g_entropy_ptr="*fp32", vocab_local="i32", num_real="i32", vocab_start="i32", inv_temp="fp32",
                    ENTROPY_GRAD="constexpr", HAS_PADDING="constexpr", BLOCK_V="constexpr")
    divisible = ("row_stride", "grad_row_stride", "vocab_local")
    for fn, sig, flag in [
        (kernels._shard_stats_kernel, stats_sig, "FINALIZE"),
        (kernels._logits_grad_kernel, grad_sig, "ENTROPY_GRAD"),
    ]:
        aligned = [i for i, (name, ty) in enumerate(sig.items()) if ty.startswith("*") or name in divisible]
        constexprs = {flag: flags, "HAS_PADDING": flags, "BLOCK_V": 4096}
        src = ASTSource(fn, sig, constexprs, {(i,): [["tt.divisibility", 16]] for i in aligned})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
        assert "ld.global.v4.b32" in ptx, f"{fn.__name__}: logits are not read 16 bytes at a time"


def _sm90_ptx(fn, sig, constexprs, num_warps):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = [i for i, (name, ty) in enumerate(sig.items()) if ty.startswith("*") or name in ("row_stride",
                                                                                              "vocab_local")]
    src = ASTSource(fn, sig, constexprs, {(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


@pytest.mark.parametrize("block_v,num_warps", [(2048, 4), (4096, 8)])
def test_lane_forward_loop_is_one_exp2_an_entry_without_block_reductions(block_v, num_warps):
    """The "lane" statistics kernel's loop over vocabulary blocks, compiled for sm_90: each thread's
    B / (32 warps) entries cost one ``ex2`` each; no barrier or warp shuffle inside the loop (each
    lane keeps its own maximum; the lanes meet once, after the loop); and no multiply by log2(e)
    anywhere (0f3FB8AA3B, what ``tl.exp`` emits before its ``ex2``): it is folded into 1 / T."""
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 4):
        pytest.skip("ASTSource attrs format of triton >= 3.4")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this session runs Triton interpreted")
    from stapo_megatron.ops import triton_kernels as kernels

    sig = dict(logits_ptr="*bf16", row_stride="i32", target_ptr="*i64", out0_ptr="*fp32", out1_ptr="*fp32",
               out2_ptr="*fp32", out3_ptr="*fp32", out4_ptr="*fp32", vocab_local="i32", num_real="i32",
               vocab_start="i32", inv_temp="fp32", log2e_inv_temp="fp32",
               FINALIZE="constexpr", HAS_PADDING="constexpr", BLOCK_V="constexpr")
    ptx = _sm90_ptx(kernels._shard_stats_lane_kernel, sig, {"FINALIZE": True, "HAS_PADDING": False, "BLOCK_V": block_v},
                    num_warps).splitlines()
    header = next(i for i, line in enumerate(ptx) if line.endswith("// %.lr.ph"))  # the loop's first block
    label = ptx[header].split(":")[0]
    back_edge = max(i for i, line in enumerate(ptx) if "bra" in line and line.rstrip().endswith(label + ";"))
    loop = ptx[header:back_edge + 1]
    assert sum("ex2.approx" in line for line in loop) == block_v // (32 * num_warps)
    assert not [line for line in loop if "bar.sync" in line or "shfl.sync" in line]
    assert not [line for line in ptx if "0f3FB8AA3B" in line]
    assert any("bar.sync" in line for line in ptx[back_edge:])  # the lanes meet after the loop


@pytest.mark.parametrize("name,with_grad,no_grad", [
    ("NVIDIA H200", (2048, 4), (2048, 4)),
    ("NVIDIA H200 NVL", (2048, 4), (2048, 4)),
    ("NVIDIA H100 80GB HBM3", (4096, 8), (2048, 4)),
    ("NVIDIA H100 PCIe", (4096, 8), (2048, 4)),
    ("NVIDIA GH200 480GB", (4096, 8), (4096, 8)),  # not an H200: the default
    ("NVIDIA A100-SXM4-80GB", (4096, 8), (4096, 8)),
    ("", (4096, 8), (4096, 8)),  # the interpreter
])
def test_launch_shapes_are_looked_up_by_device_name(name, with_grad, no_grad):
    """The table's entry for each measured device, the default for any other."""
    pytest.importorskip("triton")
    from stapo_megatron.ops import triton_kernels as kernels

    assert kernels.launch_shapes(name) == (with_grad, no_grad)
    if not name.startswith("NVIDIA H"):
        assert kernels.launch_shapes(name) == kernels.DEFAULT_LAUNCH_SHAPES
    for _, *shapes in kernels.LAUNCH_SHAPES:  # powers of two the kernels can take, as swept
        assert all(block & (block - 1) == 0 and warps in (1, 2, 4, 8, 16, 32) for block, warps in shapes)
