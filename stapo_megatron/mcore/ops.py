"""Fused log-probability and entropy on tensor-parallel vocabulary-sharded logits.

STAPO needs, for every response token, log p(y_t) (differentiable: the policy-gradient term)
and the full-vocabulary entropy H_t (a constant: it only selects the S2T mask). With the output
layer column-parallel, rank r of the TP group holds logits for vocabulary ids
[r * V_local, (r + 1) * V_local). This module computes both without gathering logits:

    step 1  local pass (one read of the shard, in cache-sized row chunks): per row a reference
            point m_r and the sums relative to it, s_r = sum exp(z - m_r),
            w_r = sum exp(z - m_r) (z - m_r), the target logit z_y and, when asked
            (``with_collision``), q_r = sum exp(2 (z - m_r))
    step 2  all-reduce MAX of m_r                                  -> global reference M
    step 3  rescale to M and all-reduce SUM of the packed (s, w, z_y[, q]):
                S = sum_r exp(m_r - M) s_r
                W = sum_r exp(m_r - M) (w_r + (m_r - M) s_r)
                Q = sum_r exp(2 (m_r - M)) q_r
    step 4  normalise: log Z = M + log S, log p = z_y - log Z, H = log S - W / S, sum_v p_v^2 = Q / S^2

with z = logits / temperature and m_r the local max z (every exp(z - m_r) <= 1). The torch path
gets exp(z - m_r) from torch's fused softmax kernel, at less than the cost of ``torch.exp`` alone:
its local softmax p is exp(z - m_r) times one per-row factor, the largest entry p_max_r, so
s_r, w_r and q_r are the sums of p, p (z - m_r) and p^2 divided by p_max_r (and p_max_r^2). The
softmax's own normaliser is not used: torch's CPU kernel accumulates it in fp32 term by term and
loses the small terms beside a dominant token (``_softmax_sums``).
When a gradient is needed, the torch path also writes that local softmax into the buffer that
backward will return, so backward is one in-place rescale by the per-row factor
-g exp(m_r - M) / (S p_max_r T) plus the target entries g (1 - p_y) / T
(computed in fp32 and written, never added to a rounded value): no second exp pass and no
collective (the column-parallel output layer all-reduces its input gradient itself). Without a
gradient only cache-sized fp32 scratch is used. The input is not modified unless the caller asks
for it (``inplace_backward``; Megatron's vocab_parallel_cross_entropy always overwrites fp32
logits, the cause of verl #1672/#2484) and no fp32 copy of the shard is held beyond the
returned gradient. Like Megatron's CE, backward runs once (no retain_graph double backward).

Two implementations compute such partials and share steps 2-4: this module's torch path
(CPU, and the reference) and the Triton kernels of ``stapo_megatron.mcore.kernels.logprob_entropy``
(chosen on CUDA tensors), whose forward reads each shard once and writes only [N] outputs and
whose backward reads the logits once and writes the gradient once. Both take two options that
change the backward: ``entropy_grad`` (a gradient also flows into H, dH/dz = -p (log p + H)) and
``inplace_backward`` (the gradient is written over the logits); with either, the torch path
recomputes p from the logits in backward instead of keeping the local softmax.

The collision probability sum_v p_v^2 (at the same temperature) is what the squared norm of a
token's logit gradient needs: ||d log p(y) / dz||^2 = 1 - 2 p(y) + sum_v p_v^2
(``stapo_megatron.mcore.loss_metrics``). It rides in the packed SUM of step 3 (a fourth row of the
same all-reduce, so still 2 collectives), is a constant (no gradient) and changes neither the
log-prob, the entropy nor their gradients: it is one more sum over the probabilities step 1
already has in cache. The Triton forward always computes it (one more FMA per element of a
memory-bound pass); the torch path only when asked (one more read of a cache-resident chunk,
paid for by the fused softmax: benchmarks/bench_collision_cost.py).

Masked vocabulary entries (logits = -inf) have p = 0 and contribute 0 log 0 = 0 to H; a shard
whose entries are all -inf contributes nothing. A row with no finite logit on any rank has no
distribution and gives NaN.

Legend: N = flattened tokens, V = local vocabulary shard size, C = rows in one chunk.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import Optional, Tuple

import torch
import torch.distributed as dist

# Rows per chunk are chosen so that one fp32 chunk stays around this size (cache-resident on
# current CPUs and far below GPU shared-memory pressure); see benchmarks/bench_logprob_entropy.py.
_CHUNK_BYTES = 5 << 19  # 2.5 MiB: 4 rows of a 151936 vocabulary
# On GPU the loop is bounded by kernel launches rather than cache: use large chunks.
_CHUNK_BYTES_CUDA = 1 << 28
_NEG_MAX = torch.finfo(torch.float32).min  # 0 * it is 0 where 0 * -inf would be NaN
_IMPLS = ("auto", "torch", "triton")


def _rows_per_chunk(vocab_local: int, device: torch.device) -> int:
    budget = _CHUNK_BYTES_CUDA if device.type == "cuda" else _CHUNK_BYTES
    return max(1, budget // (4 * vocab_local))


def _local_stats(logits_NV, target_N, vocab_start, inv_temp, p_out_NV=None, with_collision=False):
    """Step 1 (torch path): per row the partials relative to the local max m_r (s_r, w_r, the
    target logit and, if ``with_collision``, q_r; else that partial is None), all fp32, and the
    largest local softmax entry p_max_r. A row whose shard is all -inf has m_r = -inf,
    s_r = w_r = q_r = 0 and p_max_r = 1.

    If ``p_out_NV`` is given, the local softmax p = p_max_r exp(z - m_r) is also written into it:
    that buffer becomes the returned gradient, so backward is a single in-place rescale.
    """
    num_rows, vocab = logits_NV.shape
    fp32 = dict(dtype=torch.float32, device=logits_NV.device)
    m_N, s_N, w_N, p_max_N = (torch.empty(num_rows, **fp32) for _ in range(4))
    q_N = torch.empty(num_rows, **fp32) if with_collision else None
    chunk = _rows_per_chunk(vocab, logits_NV.device)
    shifted_CV = torch.empty(min(chunk, num_rows), vocab, **fp32)
    p_CV = torch.empty_like(shifted_CV)
    z_is_input = logits_NV.dtype == torch.float32 and inv_temp == 1.0 and logits_NV.is_contiguous()
    write_p_in_place = p_out_NV is not None and p_out_NV.dtype == torch.float32 and p_out_NV.is_contiguous()
    for start in range(0, num_rows, chunk):
        x_CV = logits_NV[start : start + chunk]
        end = start + x_CV.shape[0]
        shifted = shifted_CV[: end - start]
        p = p_out_NV[start:end] if write_p_in_place else p_CV[: end - start]
        z = x_CV if z_is_input else _scaled_fp32(x_CV, inv_temp, out=shifted)
        z_max_C = z.amax(dim=-1, keepdim=True)
        torch.softmax(z, dim=-1, out=p)
        torch.sub(z, z_max_C, out=shifted)  # z - m_r <= 0; -inf where p = 0
        sums = _softmax_sums(p, shifted, z_max_C, with_collision)
        if p_out_NV is not None and not write_p_in_place:
            p_out_NV[start:end].copy_(p)
        m_N[start:end], s_N[start:end], w_N[start:end], p_max_N[start:end] = z_max_C.squeeze(-1), *sums[:3]
        if with_collision:
            q_N[start:end] = sums[3]
    local_ids_N = target_N - vocab_start
    owned_N = (local_ids_N >= 0) & (local_ids_N < vocab)
    picked_N = logits_NV.gather(-1, local_ids_N.clamp(0, vocab - 1).unsqueeze(-1)).squeeze(-1)
    z_target_N = torch.where(owned_N, picked_N.float() * inv_temp, 0.0)
    return (m_N, s_N, w_N, z_target_N, q_N), p_max_N


def _scaled_fp32(x_CV, inv_temp, out):
    """z = x / T in fp32, written into ``out``: upcast before scaling, since x / T rounded in bf16
    would lose the low bits."""
    out.copy_(x_CV)
    return out.mul_(inv_temp) if inv_temp != 1.0 else out


def _softmax_sums(p_CV, shifted_CV, z_max_C, with_collision):
    """(s, w, p_max, q or None) of a chunk, [C] each, from its softmax p and shifted = z - max z
    (scratch: overwritten).

    torch's fused softmax (max, exp and sum in one kernel, with a cheaper vectorised exp) costs
    less than ``torch.exp`` alone, but its CPU kernel adds up exp(z - max z) in fp32 vector lanes
    one term after another: where one token dominates, the lane that holds its exp(0) = 1 drops
    every term below 2^-24, and at V = 151,936 the normaliser comes out up to 2e-5 too small
    (p off by as much). The kernel's p is still exp(z - max z) times one per-row factor, to an
    ulp: that factor is p_max (exp(0) times it), so the sums relative to m_r = max z are the
    cascade sums of p divided by p_max, and the normaliser's error never reaches the results.
    The products are formed in the scratch (cheaper than ``vecdot``'s temporary).
    """
    p_max_C, s_C = p_CV.amax(dim=-1), p_CV.sum(dim=-1)
    products_CV = shifted_CV.mul_(p_CV)
    w_C = products_CV.sum(dim=-1)
    if w_C.isnan().any():  # -inf logits; done only for chunks that have them
        # an entry with p = 0 adds 0 (z - m_r) = 0 log 0 = 0; a row whose shard is all -inf (its
        # softmax is 0 / 0) is zeroed and gets p_max = 1, so that it contributes nothing
        dead_C = z_max_C.squeeze(-1) == float("-inf")
        p_CV[dead_C] = 0.0
        products_CV[dead_C] = 0.0
        s_C.masked_fill_(dead_C, 0.0)
        p_max_C.masked_fill_(dead_C, 1.0)
        w_C = products_CV.nan_to_num_(nan=0.0).sum(dim=-1)
    # p is still cache-resident: the collision sum is a second read of it, not of the shard
    q_C = torch.mul(p_CV, p_CV, out=products_CV).sum(dim=-1) / p_max_C.square() if with_collision else None
    return s_C / p_max_C, w_C / p_max_C, p_max_C, q_C


def _reduce_stats(m_N, s_N, w_N, z_target_N, q_N, tp_group):
    """Steps 2-3: MAX then one packed SUM over the TP group; returns global (M, S, W, z_y, Q),
    Q None when ``q_N`` is (no collision sum asked for)."""
    global_m_N = m_N.clone()
    if tp_group is not None:
        dist.all_reduce(global_m_N, op=dist.ReduceOp.MAX, group=tp_group)
    shift_N = (m_N - global_m_N).clamp(min=_NEG_MAX)  # <= 0; finite when this shard is all -inf
    scale_N = shift_N.exp()
    rows = [s_N * scale_N, scale_N * (w_N + shift_N * s_N), z_target_N]
    if q_N is not None:  # exp(2 shift) = scale^2; the same all-reduce, one row more
        rows.append(q_N * scale_N.square())
    packed_KN = torch.stack(rows)
    if tp_group is not None:
        dist.all_reduce(packed_KN, op=dist.ReduceOp.SUM, group=tp_group)
    return global_m_N, packed_KN[0], packed_KN[1], packed_KN[2], None if q_N is None else packed_KN[3]


def _normalise(global_m_N, sum_exp_N, sum_w_N, z_y_N, sum_q_N=None):
    """Step 4: (log Z, log p, H, sum_v p_v^2 or None) from the global statistics."""
    log_sum_exp_N = sum_exp_N.log()
    log_z_N = global_m_N + log_sum_exp_N
    collision_N = None if sum_q_N is None else sum_q_N / sum_exp_N.square()
    return log_z_N, z_y_N - log_z_N, log_sum_exp_N - sum_w_N / sum_exp_N, collision_N


def _grad_from_logits(logits_NV, out_NV, target_N, vocab_start, num_real, inv_temp, log_z_N, g_N, entropy_N, h_N):
    """Backward by recomputing p from the logits and the global log Z, one row chunk at a time.

    Writes [g (onehot(y) - p) - h p (log p + H)] / T into ``out_NV`` (which may be
    ``logits_NV``: each chunk is read before it is written); ``h_N`` None = no entropy gradient.
    """
    num_rows = logits_NV.shape[0]
    out_NV[:, num_real:] = 0
    chunk = _rows_per_chunk(num_real, logits_NV.device)
    g_N = g_N.float() * inv_temp
    h_N = None if h_N is None else h_N.float() * inv_temp
    local_ids_N = target_N - vocab_start
    owned_N = (local_ids_N >= 0) & (local_ids_N < num_real)
    for start in range(0, num_rows, chunk):
        end = min(start + chunk, num_rows)
        logp_CV = logits_NV[start:end, :num_real].to(torch.float32, copy=True).mul_(inv_temp)
        logp_CV.sub_(log_z_N[start:end, None]).clamp_(min=_NEG_MAX)
        p_CV = logp_CV.exp()
        grad_CV = p_CV * -g_N[start:end, None]
        if h_N is not None:
            grad_CV -= h_N[start:end, None] * p_CV * logp_CV.add_(entropy_N[start:end, None])
        rows_C = owned_N[start:end].nonzero().squeeze(-1)
        grad_CV[rows_C, local_ids_N[start:end][rows_C]] += g_N[start:end][rows_C]  # fp32: no cancellation
        out_NV[start:end, :num_real] = grad_CV
    return out_NV


_NO_GRADS = (None,) * 9  # for the non-tensor (and integer) inputs of the autograd functions


def _outputs(ctx, logprob_N, entropy_N, collision_N, entropy_grad):
    """The autograd functions' outputs: the collision sum (a placeholder when not asked for) and,
    unless ``entropy_grad``, the entropy are constants."""
    collision_N = logprob_N.new_empty(0) if collision_N is None else collision_N
    ctx.mark_non_differentiable(collision_N, *(() if entropy_grad else (entropy_N,)))
    return logprob_N, entropy_N, collision_N


class _LogprobEntropy(torch.autograd.Function):
    """The torch path: CPU, and the reference for the Triton kernels."""

    @staticmethod
    def forward(
        ctx, logits_NV, target_N, vocab_start, num_real, inv_temp, tp_group, needs_grad, entropy_grad, inplace,
        with_collision,
    ):
        # With a log-prob-only gradient to come, the local softmax exp(z - m_r) goes straight
        # into the buffer that backward returns (logits' dtype): no extra copy of the shard is
        # held, and backward needs no second exp pass. An entropy gradient needs log p, and an
        # in-place backward needs the logits' storage, so both recompute p in backward instead.
        # Without grad, only cache-sized scratch is used.
        recompute = entropy_grad or inplace
        grad_NV = torch.empty_like(logits_NV) if needs_grad and not recompute else None
        real_NV, p_out_NV = logits_NV, grad_NV
        if num_real < logits_NV.shape[-1]:
            # Padded vocabulary rows of the output layer (Megatron pads to a multiple of 128 x TP)
            # are not tokens: leave them out of the softmax; their gradient is zero.
            real_NV = logits_NV[:, :num_real]
            if grad_NV is not None:
                grad_NV[:, num_real:] = 0
                p_out_NV = grad_NV[:, :num_real]
        partials, p_max_N = _local_stats(real_NV, target_N, vocab_start, inv_temp, p_out_NV, with_collision)
        global_stats = _reduce_stats(*partials, tp_group)
        log_z_N, logprob_N, entropy_N, collision_N = _normalise(*global_stats)
        if grad_NV is not None:
            # p = exp(z - log Z) = [p_max_r exp(z - m_r)] exp(m_r - M) / (S p_max_r): the bracket is
            # the buffer, the rest the per-row factor applied in backward (1 / sum of the buffer at
            # TP = 1), formed from M and S rather than log Z, whose rounding (half an ulp of a
            # logit) would scale the whole row.
            global_m_N, sum_exp_N = global_stats[:2]
            row_scale_N = (partials[0] - global_m_N).clamp(min=_NEG_MAX).exp() / (sum_exp_N * p_max_N)
            ctx.save_for_backward(grad_NV, target_N, row_scale_N, logprob_N)
        elif needs_grad:
            ctx.save_for_backward(logits_NV, target_N, log_z_N, entropy_N)
        ctx.vocab_start, ctx.num_real, ctx.inv_temp = vocab_start, num_real, inv_temp
        ctx.recompute, ctx.entropy_grad, ctx.inplace = recompute, entropy_grad, inplace
        return _outputs(ctx, logprob_N, entropy_N, collision_N, entropy_grad)

    @staticmethod
    def backward(ctx, grad_logprob_N, grad_entropy_N, _grad_collision_N):
        # d logp / d x = (onehot(y) - p) / T on the local shard; no collective (the column-
        # parallel output layer all-reduces its input gradient itself).
        if ctx.recompute:
            logits_NV, target_N, log_z_N, entropy_N = ctx.saved_tensors
            out_NV = logits_NV.detach() if ctx.inplace else torch.empty_like(logits_NV)
            h_N = grad_entropy_N if ctx.entropy_grad else None
            grad_NV = _grad_from_logits(
                logits_NV, out_NV, target_N, ctx.vocab_start, ctx.num_real, ctx.inv_temp,
                log_z_N, grad_logprob_N, entropy_N, h_N,
            )
            return grad_NV, *_NO_GRADS
        grad_NV, target_N, row_scale_N, logprob_N = ctx.saved_tensors
        vocab = grad_NV.shape[-1]
        g_N = grad_logprob_N.float() * ctx.inv_temp
        grad_NV.mul_((-g_N * row_scale_N).to(grad_NV.dtype).unsqueeze(-1))
        # The target entry g (1 - p_y) is computed in fp32 and written, not added: adding g to
        # a rounded -p g would cancel catastrophically in bf16 where p_y -> 1.
        local_ids_N = target_N - ctx.vocab_start
        rows_N = ((local_ids_N >= 0) & (local_ids_N < vocab)).nonzero().squeeze(-1)
        target_grad = g_N[rows_N] * (1.0 - logprob_N[rows_N].exp())
        grad_NV[rows_N, local_ids_N[rows_N]] = target_grad.to(grad_NV.dtype)
        return grad_NV, *_NO_GRADS


class _LogprobEntropyTriton(torch.autograd.Function):
    """The Triton path: forward reads the shard once, backward reads it once and writes once.

    Only [N] statistics are kept for backward besides a reference to the logits (no copy).
    """

    @staticmethod
    def forward(
        ctx, logits_NV, target_N, vocab_start, num_real, inv_temp, tp_group, needs_grad, entropy_grad, inplace,
        with_collision,
    ):
        from stapo_megatron.mcore.kernels import logprob_entropy as kernels

        if tp_group is None:  # the kernel finishes the rows itself: no partials, no extra launches
            logprob_N, entropy_N, log_z_N, collision_N = kernels.shard_stats(
                logits_NV, target_N, vocab_start, num_real, inv_temp, finalize=True
            )
        else:
            partials = kernels.shard_stats(logits_NV, target_N, vocab_start, num_real, inv_temp, finalize=False)
            if not with_collision:  # the kernel wrote q anyway; it need not travel
                partials = partials[:4] + (None,)
            log_z_N, logprob_N, entropy_N, collision_N = _normalise(*_reduce_stats(*partials, tp_group))
        if needs_grad:
            ctx.save_for_backward(logits_NV, target_N, log_z_N, entropy_N)
        ctx.vocab_start, ctx.num_real, ctx.inv_temp = vocab_start, num_real, inv_temp
        ctx.entropy_grad, ctx.inplace = entropy_grad, inplace
        return _outputs(ctx, logprob_N, entropy_N, collision_N if with_collision else None, entropy_grad)

    @staticmethod
    def backward(ctx, grad_logprob_N, grad_entropy_N, _grad_collision_N):
        from stapo_megatron.mcore.kernels import logprob_entropy as kernels

        logits_NV, target_N, log_z_N, entropy_N = ctx.saved_tensors
        grad_NV = kernels.logits_grad(
            logits_NV, target_N, ctx.vocab_start, ctx.num_real, ctx.inv_temp, log_z_N, grad_logprob_N,
            entropy_N if ctx.entropy_grad else None,
            grad_entropy_N if ctx.entropy_grad else None,
            out_NV=logits_NV.detach() if ctx.inplace else None,
        )
        return grad_NV, *_NO_GRADS


def vocab_shard(vocab_local: int, tp_group: Optional[dist.ProcessGroup], vocab_size: Optional[int]):
    """This TP rank's place in a vocabulary-sharded output layer.

    Returns (tp_group or None when TP = 1, tp_size, tp_rank, real vocabulary size, number of
    real (non-padding) entries in this rank's shard). Raises if the shard holds only padding.
    """
    tp_size, tp_rank = 1, 0
    if tp_group is not None:
        tp_size, tp_rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if tp_size == 1:
            tp_group = None
    total = vocab_local * tp_size
    vocab_size = total if vocab_size is None else vocab_size
    if not 0 < vocab_size <= total:
        raise ValueError(f"vocab_size {vocab_size} must be in [1, {total}] (V_local {vocab_local} x TP {tp_size})")
    num_real = min(vocab_local, vocab_size - tp_rank * vocab_local)
    if num_real <= 0:
        raise ValueError(
            f"TP rank {tp_rank} holds only padding (vocab_size {vocab_size}, V_local {vocab_local}); "
            "reduce make_vocab_size_divisible_by"
        )
    return tp_group, tp_size, tp_rank, vocab_size, num_real


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    *,
    entropy_grad: bool = False,
    inplace_backward: bool = False,
    impl: str = "auto",
    with_collision: bool = False,
) -> Tuple[torch.Tensor, ...]:
    """Log-probability of ``target`` and full-vocabulary entropy from vocab-sharded logits.

    Args:
        logits: [..., V_local], fp32, bf16 or fp16. Rank r of ``tp_group`` holds vocabulary ids
            [r * V_local, (r + 1) * V_local). Never modified, unless ``inplace_backward``.
            Masked entries may be -inf (they get probability 0).
        target: [...] global token ids (an integer dtype).
        tp_group: tensor-parallel group over which the vocabulary is sharded; None = unsharded.
        temperature: logits are divided by it, exactly as the rollout sampler does (vLLM
            applies ``logits / temperature`` before softmax), so train and rollout log-probs
            are comparable. Finite and > 0.
        vocab_size: the real vocabulary size when the output layer is padded (Megatron pads to
            a multiple of make_vocab_size_divisible_by x TP): ids >= vocab_size are excluded
            from the softmax, as the tokenizer and vLLM never see them. None = no padding.
        entropy_grad: let a gradient flow into the entropy too (dH/dz = -p (log p + H) / T);
            by default it is a constant, as the S2T mask needs.
        inplace_backward: backward may write the gradient over ``logits``' storage (as Megatron's
            cross entropy does), so no second logits-sized buffer exists. Only when nothing else
            reads those logits after this op's backward.
        impl: "triton" (the kernels of ``stapo_megatron.mcore.kernels.logprob_entropy``: CUDA tensors,
            or Triton's interpreter), "torch" (any device; the reference), or "auto" = Triton on
            CUDA tensors when Triton is installed, torch otherwise.
        with_collision: also return the collision probability sum_v p_v^2 of softmax(logits / T)
            (a constant), for the per-token logit-gradient norm
            (``stapo_megatron.mcore.loss_metrics.logit_grad_sq_norm``).

    Returns:
        (logprob, entropy) or, with ``with_collision``, (logprob, entropy, collision): fp32
        tensors of ``target``'s shape. ``logprob`` = log softmax(logits / T)[target],
        differentiable w.r.t. ``logits``; ``entropy`` = -sum_v p log p of softmax(logits / T),
        detached unless ``entropy_grad``. Exactly 2 collectives over ``tp_group`` per call, none
        in backward.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} must be target shape {tuple(target.shape)} + [V_local]"
        )
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"logits must be floating point (fp32/bf16/fp16), got {logits.dtype}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer token ids, got dtype {target.dtype}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    vocab_local = logits.shape[-1]
    tp_group, tp_size, tp_rank, vocab_size, num_real = vocab_shard(vocab_local, tp_group, vocab_size)
    if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab_size):
        raise ValueError(
            f"target ids must lie in [0, {vocab_size}) (V_local {vocab_local} x TP {tp_size}, "
            f"vocab_size {vocab_size}); got range [{int(target.min())}, {int(target.max())}]"
        )
    use_triton = impl == "triton" or (impl == "auto" and logits.is_cuda and _triton_installed())
    logits_NV = logits.reshape(-1, vocab_local)
    target_N = target.reshape(-1).long()
    if use_triton:  # the kernels index rows by stride and columns contiguously
        logits_NV = logits_NV if logits_NV.stride(-1) == 1 else logits_NV.contiguous()
        target_N = target_N.contiguous()
    function = _LogprobEntropyTriton if use_triton else _LogprobEntropy
    needs_grad = torch.is_grad_enabled() and logits.requires_grad
    logprob_N, entropy_N, collision_N = function.apply(
        logits_NV, target_N, tp_rank * vocab_local, num_real, 1.0 / float(temperature), tp_group,
        needs_grad, entropy_grad, inplace_backward, with_collision,
    )
    if with_collision:
        return logprob_N.view(target.shape), entropy_N.view(target.shape), collision_N.view(target.shape)
    return logprob_N.view(target.shape), entropy_N.view(target.shape)


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None
