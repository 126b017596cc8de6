"""Triton kernels for the vocab-parallel log-prob + entropy op (``logprob_entropy.vocab_parallel_logprob_entropy``).

This module owns the two passes over the logits that the op makes on a GPU; the TP combination
(``combine.reduce_stats``: MAX, then one packed SUM) and the autograd wiring (``triton_path``) are not here.

    forward   one read of each row's local shard, one program per row, looping over vocabulary
              blocks. With z = x / T, per row:
                  m_r = max_v z_v
                  s_r = sum_v exp(z_v - m_r)
                  w_r = sum_v exp(z_v - m_r) (z_v - m_r)
                  z_y = z_target if this shard owns the target, else 0
                  q_r = sum_v exp(2 (z_v - m_r))   (for the collision probability sum_v p_v^2)
              the partials ``combine.reduce_stats`` combines (``torch_path._local_stats`` gives
              the same sums from a fused softmax). Two forwards compute them (``FORWARD_VARIANTS``):
              "block" (``_shard_stats_kernel``, the one every device uses): an online maximum per
              block; when the running max moves from m to m', the sums already taken are
              rescaled, s <- a s, w <- a (w + (m - m') s), q <- a^2 q with a = exp(m - m'), which
              is rare after the first blocks and done only then; sums are kept per lane and
              reduced once at the end of the row, so a block costs one max-reduction and one exp
              per element. "lane" (``_shard_stats_lane_kernel``, the candidate for Hopper, whose
              "block" forward measured instruction-bound): each lane keeps its own maximum and
              sums (an online softmax per lane), in base 2 with log2(e) folded into 1 / T:
              d = (x - x_max) log2(e) / T, e = 2^d, one exp2 an entry; when an entry raises its
              lane's maximum (d > 0) the lane's sums are rescaled, s <- a s, w <- a (w - d s),
              q <- a^2 q with a = 2^-d, and the entry counts 1, otherwise it adds e = 2^d (both
              from the one exp2 of -|d|); no block-wide reduction or barrier inside the loop, the
              lanes brought to the row's maximum once at the end (its reference m_r is the row's
              largest raw logit times 1 / T in fp32, as the backward computes that entry's z). It
              trades the per-block reduction for more arithmetic per entry (21.7 against 13.6
              instructions a logit in sm_90 PTX), so which is faster is the GPU's to say: it is
              chosen per device only from a measured run (``benchmarks/bench_logprob_entropy.py``
              times both). Unsharded (TP = 1), either kernel finishes the row itself
              (log Z = m + log s, log p = z_y - log Z, H = log s - w / s, sum p^2 = q / s^2) and
              writes only log p, H, log Z and sum p^2: no logits-sized buffer, and no extra
              launches.
    backward  one read of the logits and one write of the gradient per element, for the
              upstream gradients g (of log p) and h (of H):
                  d/dx_v = [ g (1[v = y] - p_v) - h p_v (log p_v + H) ] / T,
                  log p_v = z_v - log Z  (global log Z, so no collective is needed here)
              computed in fp32 and rounded once. The gradient may be written over the logits
              themselves (the caller's ``inplace_backward``): each block is read before it is
              written by the same program.

Entries past ``num_real`` (padded vocabulary) are read as -inf: probability 0, gradient 0.
Logits that are -inf (masked vocabulary) contribute 0 log 0 = 0: differences are clamped to the
most negative finite float before they meet a zero probability.

Launch shapes (block size B, warps) come from a table per device (``LAUNCH_SHAPES``), one shape
for the two kernels when a gradient will be taken and one for the forward alone, each the best of
a measured sweep; ``FORCED_SHAPE`` overrides them (the benchmark's sweep, the tests' small blocks).
They are plain launches, not ``triton.autotune``, because autotuning would re-run the in-place
backward.

Legend: N = flattened tokens (one program each), V = local vocabulary shard (row length),
B = vocabulary block of one loop iteration.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# (device-name pattern, (B, warps) with a gradient: forward and backward, (B, warps) without: the
# forward alone); the first pattern found in torch.cuda.get_device_name wins. Each entry is the best
# of `benchmarks/bench_logprob_entropy.py --device cuda --tune` (bf16 logits x V = 151,936, both
# kernels swept at one shape) on that device:
LAUNCH_SHAPES = (
    # NVIDIA H200, 2026-11-27, N = 16,384, two runs (benchmarks/results/h200-2026-11-27/op_16k.log and
    # h200-2026-11-27-fixes/bench_logprob_entropy_16k.log), whose sweeps both put 2048 / 4 first:
    # fwd+bwd 4.80 ms in each (1.37x the 3-pass HBM bound) against 5.10 / 4.99 ms at 4096 / 8;
    # no-grad 2.26 / 2.35 ms against 2.54 / 2.43 ms at 4096 / 8 (the "block" forward).
    (r"\bH200\b", (2048, 4), (2048, 4)),
    # NVIDIA H100 80GB HBM3, 2026-11-24, N = 4,096 (benchmarks/results/h100-2026-11-24/): fwd+bwd
    # 1.61 ms at 4096 / 8 (1.29x), the best; no-grad 0.62 ms at 2048 / 4 (1.49x the 1-pass bound)
    # against 0.69 ms at 4096 / 8 (the run's table; 0.76 in the sweep).
    (r"\bH100\b", (4096, 8), (2048, 4)),
)
DEFAULT_LAUNCH_SHAPES = ((4096, 8), (4096, 8))
"""Any other device, and the interpreter: 4096 / 8 for both (the H100's fwd+bwd best)."""

FORCED_SHAPE: Optional[Tuple[int, int]] = None
"""(B, warps) for every launch when set: the benchmark's sweep, the tests' small blocks."""

FORWARD_VARIANTS = ("block", "lane")
"""The two statistics kernels (module docstring). Every device runs "block", the one measured; a
device moves to "lane" only with a measured run that puts it first (``LANE_FORWARD_DEVICES``)."""

LANE_FORWARD_DEVICES: Tuple[str, ...] = ()
"""Device-name patterns whose forward is "lane" (none yet: it has not been timed on a GPU)."""

FORCED_FORWARD: Optional[str] = None
"""One of ``FORWARD_VARIANTS`` for every launch when set: the benchmark's comparison, the tests."""

# The most negative finite fp32 (0 * it is 0, 0 * -inf is NaN); a constexpr because kernels may
# read no other kind of global.
_NEG_MAX = tl.constexpr(-3.4028234663852886e38)
# A lane's maximum before its first entry: finite, so that x - it is never -inf - (-inf); finite
# logits are taken to be above it (-inf is masked vocabulary), and (x - it) log2(e) / T stays
# finite for any x below 1e30 and T >= 1e-7.
_SENTINEL = tl.constexpr(-1e30)
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = 1.4426950408889634


@triton.jit
def _finish_row(row, row_ptr, target_ptr, out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr, num_real, vocab_start,
                inv_temp, m, s, w, q, FINALIZE: tl.constexpr):
    """A row's end in both statistics kernels: the target's z_y if this shard owns it, then the
    finished row (TP = 1) or the partials ``combine.reduce_stats`` combines."""
    local_id = tl.load(target_ptr + row) - vocab_start
    owned = (local_id >= 0) & (local_id < num_real)
    x_y = tl.load(row_ptr + tl.where(owned, local_id, 0), mask=owned, other=0.0)
    z_y = tl.where(owned, x_y.to(tl.float32) * inv_temp, 0.0)
    if FINALIZE:
        log_s = tl.log(s)
        log_z = m + log_s
        tl.store(out0_ptr + row, z_y - log_z)  # log p
        tl.store(out1_ptr + row, log_s - w / s)  # H
        tl.store(out2_ptr + row, log_z)
        tl.store(out3_ptr + row, q / (s * s))  # sum_v p_v^2
    else:
        tl.store(out0_ptr + row, m)
        tl.store(out1_ptr + row, s)
        tl.store(out2_ptr + row, w)
        tl.store(out3_ptr + row, z_y)
        tl.store(out4_ptr + row, q)


@triton.jit
def _shard_stats_kernel(
    logits_ptr, row_stride, target_ptr,
    out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr,
    vocab_local, num_real, vocab_start, inv_temp, log2e_inv_temp,
    FINALIZE: tl.constexpr, HAS_PADDING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * row_stride overflows int32 past 2^31 elements
    row_ptr = logits_ptr + row * row_stride
    offs_B = tl.arange(0, BLOCK_V)
    m = float("-inf")
    s_B = tl.zeros([BLOCK_V], dtype=tl.float32)
    w_B = tl.zeros([BLOCK_V], dtype=tl.float32)
    q_B = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, num_real, BLOCK_V):
        cols_B = start + offs_B
        # Loads are masked by the row length (a multiple of 16 when Megatron pads the vocabulary,
        # which keeps them vectorised); padding is then set to -inf.
        x_B = tl.load(row_ptr + cols_B, mask=cols_B < vocab_local, other=float("-inf"))
        z_B = x_B.to(tl.float32) * inv_temp
        if HAS_PADDING:
            z_B = tl.where(cols_B < num_real, z_B, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_B, axis=0))
        if m_new > m:  # rare after the first blocks: rescale the lanes' sums to the new max
            shift = tl.maximum(m - m_new, _NEG_MAX)  # finite when m was -inf (the sums are 0 then)
            scale = tl.exp(shift)
            w_B = scale * (w_B + shift * s_B)
            s_B = scale * s_B
            q_B = (scale * scale) * q_B
            m = m_new
        # While every entry so far is -inf, measure from 0 so the sums stay 0 (not NaN).
        ref = tl.where(m == float("-inf"), 0.0, m)
        d_B = tl.maximum(z_B - ref, _NEG_MAX)
        e_B = tl.exp(d_B)
        w_B += e_B * d_B
        s_B += e_B
        q_B += e_B * e_B
    s = tl.sum(s_B, axis=0)
    w = tl.sum(w_B, axis=0)
    q = tl.sum(q_B, axis=0)
    _finish_row(row, row_ptr, target_ptr, out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr, num_real, vocab_start,
                inv_temp, m, s, w, q, FINALIZE)


@triton.jit
def _shard_stats_lane_kernel(
    logits_ptr, row_stride, target_ptr,
    out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr,
    vocab_local, num_real, vocab_start, inv_temp, log2e_inv_temp,
    FINALIZE: tl.constexpr, HAS_PADDING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * row_stride overflows int32 past 2^31 elements
    row_ptr = logits_ptr + row * row_stride
    offs_B = tl.arange(0, BLOCK_V)
    # Per lane: the largest raw logit seen (a finite sentinel before the first) and the sums
    # relative to it, in base 2: e = 2^d with d = (x - x_max) log2(e) / T.
    x_max_B = tl.full([BLOCK_V], _SENTINEL, dtype=tl.float32)
    s_B = tl.zeros([BLOCK_V], dtype=tl.float32)
    w_B = tl.zeros([BLOCK_V], dtype=tl.float32)
    q_B = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, num_real, BLOCK_V):
        cols_B = start + offs_B
        # Loads are masked by the row length (a multiple of 16 when Megatron pads the vocabulary,
        # which keeps them vectorised); padding is then set to -inf.
        x_B = tl.load(row_ptr + cols_B, mask=cols_B < vocab_local, other=float("-inf")).to(tl.float32)
        if HAS_PADDING:
            x_B = tl.where(cols_B < num_real, x_B, float("-inf"))
        # -inf (masked, padded) gives d = -inf, clamped so that e = 0 and e * d = 0
        d_B = tl.maximum((x_B - x_max_B) * log2e_inv_temp, _NEG_MAX)
        up_B = d_B > 0.0  # a new lane maximum: the old sums are rescaled by 2^-d, the new entry is 1
        a_B = tl.exp2(-tl.abs(d_B))  # one exp2 serves both cases: 2^d when d <= 0, 2^-d when d > 0
        old_B = tl.where(up_B, a_B, 1.0)  # factor of the sums so far
        new_B = tl.where(up_B, 1.0, a_B)  # this entry's e relative to the (new) lane maximum
        # w <- a (w - d s) on a new maximum, w + a d otherwise: w old + a d (-s or 1)
        w_B = old_B * w_B + (a_B * d_B) * tl.where(up_B, -s_B, 1.0)
        s_B = s_B * old_B + new_B
        q_B = q_B * (old_B * old_B) + new_B * new_B
        x_max_B = tl.maximum(x_max_B, x_B)
    # the lanes to the row's maximum X, once per row: one exp2 and one max-reduction per lane
    x_max = tl.max(x_max_B, axis=0)
    shift_B = tl.maximum((x_max_B - x_max) * log2e_inv_temp, _NEG_MAX)  # <= 0; finite for sentinel lanes
    scale_B = tl.exp2(shift_B)
    s = tl.sum(scale_B * s_B, axis=0)
    w = tl.sum(scale_B * (w_B + shift_B * s_B), axis=0) * _LN2  # base 2 -> natural units
    q = tl.sum((scale_B * scale_B) * q_B, axis=0)
    # the reference in natural units as the backward computes each z: fl(x inv_temp); -inf when
    # nothing in the shard is finite (s = 0), as ``combine.packed_partials`` expects
    m = tl.where(s > 0.0, x_max * inv_temp, float("-inf"))
    _finish_row(row, row_ptr, target_ptr, out0_ptr, out1_ptr, out2_ptr, out3_ptr, out4_ptr, num_real, vocab_start,
                inv_temp, m, s, w, q, FINALIZE)


@triton.jit
def _logits_grad_kernel(
    logits_ptr, row_stride, grad_ptr, grad_row_stride, target_ptr,
    log_z_ptr, g_logprob_ptr, entropy_ptr, g_entropy_ptr,
    vocab_local, num_real, vocab_start, inv_temp,
    ENTROPY_GRAD: tl.constexpr, HAS_PADDING: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row_ptr = logits_ptr + row * row_stride
    g_row_ptr = grad_ptr + row * grad_row_stride
    offs_B = tl.arange(0, BLOCK_V)
    log_z = tl.load(log_z_ptr + row)
    g = tl.load(g_logprob_ptr + row) * inv_temp
    local_id = tl.load(target_ptr + row) - vocab_start  # never matches when another rank owns it
    if ENTROPY_GRAD:
        h = tl.load(g_entropy_ptr + row) * inv_temp
        entropy = tl.load(entropy_ptr + row)
    for start in range(0, vocab_local, BLOCK_V):
        cols_B = start + offs_B
        x_B = tl.load(x_row_ptr + cols_B, mask=cols_B < vocab_local, other=float("-inf"))
        z_B = x_B.to(tl.float32) * inv_temp
        if HAS_PADDING:
            z_B = tl.where(cols_B < num_real, z_B, float("-inf"))
        logp_B = tl.maximum(z_B - log_z, _NEG_MAX)
        p_B = tl.exp(logp_B)
        grad_B = tl.where(cols_B == local_id, g, 0.0) - g * p_B
        if ENTROPY_GRAD:
            grad_B -= h * p_B * (logp_B + entropy)
        tl.store(g_row_ptr + cols_B, grad_B.to(grad_ptr.dtype.element_ty), mask=cols_B < vocab_local)


def _check_device(t: torch.Tensor) -> None:
    if not t.is_cuda and not isinstance(_shard_stats_kernel, InterpretedFunction):
        raise ValueError(
            f"the Triton path needs CUDA tensors (got {t.device}); on the CPU use impl='torch', or run "
            "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )


@functools.lru_cache(maxsize=None)
def launch_shapes(device_name: str) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """((B, warps) with a gradient, (B, warps) without) for a device named ``device_name``."""
    for pattern, with_grad, no_grad in LAUNCH_SHAPES:
        if re.search(pattern, device_name):
            return with_grad, no_grad
    return DEFAULT_LAUNCH_SHAPES


def forward_variant(logits_NV) -> str:
    """The statistics kernel for ``logits_NV``'s device: ``FORCED_FORWARD``, else "lane" on a
    device of ``LANE_FORWARD_DEVICES``, else "block"."""
    if FORCED_FORWARD is not None:
        if FORCED_FORWARD not in FORWARD_VARIANTS:
            raise ValueError(f"FORCED_FORWARD={FORCED_FORWARD!r}: one of {FORWARD_VARIANTS}")
        return FORCED_FORWARD
    name = torch.cuda.get_device_name(logits_NV.device) if logits_NV.is_cuda else ""
    return "lane" if any(re.search(pattern, name) for pattern in LANE_FORWARD_DEVICES) else "block"


def _launch_shape(logits_NV, vocab: int, with_grad: bool) -> Tuple[int, int]:
    """(B, warps) of a launch over rows of ``vocab`` entries: B no larger than the row needs."""
    if FORCED_SHAPE is not None:
        block_v, num_warps = FORCED_SHAPE
    else:
        name = torch.cuda.get_device_name(logits_NV.device) if logits_NV.is_cuda else ""
        block_v, num_warps = launch_shapes(name)[0 if with_grad else 1]
    return min(block_v, max(16, triton.next_power_of_2(vocab))), num_warps


def shard_stats(
    logits_NV, target_N, vocab_start: int, num_real: int, inv_temp: float, finalize: bool, with_grad: bool,
):
    """One read of the local shard per row (forward).

    Args:
        logits_NV: [N, V] fp32/bf16/fp16 with unit stride along V.
        target_N: [N] int64 global target ids.
        vocab_start: global id of this shard's first entry.
        num_real: entries of the shard that are real vocabulary (the rest is padding).
        inv_temp: 1 / temperature.
        finalize: the shard is the whole vocabulary (TP = 1): finish the rows here.
        with_grad: ``logits_grad`` will follow (the launch shape of the pair, not the forward's alone).

    Returns:
        finalize: (log p, H, log Z, sum_v p_v^2), fp32 [N]; else the partials
        (m_r, s_r, w_r, z_y, q_r), fp32 [N].
    """
    _check_device(logits_NV)
    num_rows = logits_NV.shape[0]
    outs = [torch.empty(num_rows, dtype=torch.float32, device=logits_NV.device) for _ in range(5)]
    if num_rows:
        block_v, num_warps = _launch_shape(logits_NV, num_real, with_grad)
        with torch.cuda.device(logits_NV.device) if logits_NV.is_cuda else contextlib.nullcontext():
            kernel = _shard_stats_lane_kernel if forward_variant(logits_NV) == "lane" else _shard_stats_kernel
            kernel[(num_rows,)](
                logits_NV, logits_NV.stride(0), target_N, *outs, logits_NV.shape[1], num_real, vocab_start, inv_temp,
                _LOG2E * inv_temp,
                FINALIZE=finalize, HAS_PADDING=num_real < logits_NV.shape[1],
                BLOCK_V=block_v, num_warps=num_warps,
            )
    return tuple(outs[:4]) if finalize else tuple(outs)


def logits_grad(
    logits_NV, target_N, vocab_start: int, num_real: int, inv_temp: float,
    log_z_N, g_logprob_N, entropy_N=None, g_entropy_N=None, out_NV=None,
):
    """One read of the logits and one write of the gradient (backward).

    Args:
        logits_NV, target_N, vocab_start, num_real, inv_temp: as for ``shard_stats``.
        log_z_N: [N] fp32 global log-partition of logits / T (all TP ranks).
        g_logprob_N: [N] upstream gradient of log p.
        entropy_N, g_entropy_N: [N] entropy and its upstream gradient, or None when no gradient
            flows into the entropy.
        out_NV: where to write the gradient (``logits_NV`` itself for an in-place backward);
            None = a new tensor like ``logits_NV``.

    Returns:
        [N, V] gradient w.r.t. ``logits_NV`` in its dtype; padded entries are 0.
    """
    _check_device(logits_NV)
    out_NV = torch.empty_like(logits_NV) if out_NV is None else out_NV
    num_rows, vocab_local = logits_NV.shape
    entropy_grad = g_entropy_N is not None
    if num_rows:
        g_logprob_N = g_logprob_N.float().contiguous()
        g_entropy_N = g_entropy_N.float().contiguous() if entropy_grad else g_logprob_N
        entropy_N = entropy_N if entropy_grad else log_z_N
        block_v, num_warps = _launch_shape(logits_NV, vocab_local, with_grad=True)
        with torch.cuda.device(logits_NV.device) if logits_NV.is_cuda else contextlib.nullcontext():
            _logits_grad_kernel[(num_rows,)](
                logits_NV, logits_NV.stride(0), out_NV, out_NV.stride(0), target_N,
                log_z_N, g_logprob_N, entropy_N, g_entropy_N,
                vocab_local, num_real, vocab_start, inv_temp,
                ENTROPY_GRAD=entropy_grad, HAS_PADDING=num_real < vocab_local,
                BLOCK_V=block_v, num_warps=num_warps,
            )
    return out_NV
