"""The torch path of the op: step 1 on any device in cache-sized row chunks, and its backward
(the CPU path, and the reference for the Triton kernels; ``logprob_entropy`` has the algorithm).

Step 1 gets exp(z - m_r), m_r the local max z, from torch's fused softmax kernel, at less than the
cost of ``torch.exp`` alone: its local softmax p is exp(z - m_r) times one per-row factor, the
largest entry p_max_r, so s_r, w_r and q_r are the sums of p, p (z - m_r) and p^2 divided by
p_max_r (and p_max_r^2). The softmax's own normaliser is not used: torch's CPU kernel accumulates
it in fp32 term by term and loses the small terms beside a dominant token (``_softmax_sums``).

When a gradient is needed, the local softmax is also written into the buffer that backward will
return, so backward is one in-place rescale by the per-row factor -g exp(m_r - M) / (S p_max_r T)
plus the target entries g (1 - p_y) / T (computed in fp32 and written, never added to a rounded
value): no second exp pass and no collective (the column-parallel output layer all-reduces its
input gradient itself). With ``entropy_grad`` or ``inplace_backward``, backward recomputes p from
the logits instead. Without a gradient only cache-sized fp32 scratch is used.

The collision sum q_r is computed only when asked: one more read of a cache-resident chunk, paid
for by the fused softmax (benchmarks/bench_collision_cost.py).

Legend: N = flattened tokens, V = local vocabulary shard size, C = rows in one chunk.
"""

from __future__ import annotations

import torch

from stapo_megatron.ops.combine import NEG_MAX, NO_GRADS, autograd_outputs, normalise, reduce_stats

# Rows per chunk are chosen so that one fp32 chunk stays around this size (cache-resident on
# current CPUs and far below GPU shared-memory pressure); see benchmarks/bench_logprob_entropy.py.
_CHUNK_BYTES = 5 << 19  # 2.5 MiB: 4 rows of a 151936 vocabulary
# On GPU the loop is bounded by kernel launches rather than cache: use large chunks.
_CHUNK_BYTES_CUDA = 1 << 28


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
        logp_CV.sub_(log_z_N[start:end, None]).clamp_(min=NEG_MAX)
        p_CV = logp_CV.exp()
        grad_CV = p_CV * -g_N[start:end, None]
        if h_N is not None:
            grad_CV -= h_N[start:end, None] * p_CV * logp_CV.add_(entropy_N[start:end, None])
        rows_C = owned_N[start:end].nonzero().squeeze(-1)
        grad_CV[rows_C, local_ids_N[start:end][rows_C]] += g_N[start:end][rows_C]  # fp32: no cancellation
        out_NV[start:end, :num_real] = grad_CV
    return out_NV


class LogprobEntropyTorch(torch.autograd.Function):
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
        global_stats = reduce_stats(*partials, tp_group)
        log_z_N, logprob_N, entropy_N, collision_N = normalise(*global_stats)
        if grad_NV is not None:
            # p = exp(z - log Z) = [p_max_r exp(z - m_r)] exp(m_r - M) / (S p_max_r): the bracket is
            # the buffer, the rest the per-row factor applied in backward (1 / sum of the buffer at
            # TP = 1), formed from M and S rather than log Z, whose rounding (half an ulp of a
            # logit) would scale the whole row.
            global_m_N, sum_exp_N = global_stats[:2]
            row_scale_N = (partials[0] - global_m_N).clamp(min=NEG_MAX).exp() / (sum_exp_N * p_max_N)
            ctx.save_for_backward(grad_NV, target_N, row_scale_N, logprob_N)
        elif needs_grad:
            ctx.save_for_backward(logits_NV, target_N, log_z_N, entropy_N)
        ctx.vocab_start, ctx.num_real, ctx.inv_temp = vocab_start, num_real, inv_temp
        ctx.recompute, ctx.entropy_grad, ctx.inplace = recompute, entropy_grad, inplace
        return autograd_outputs(ctx, logprob_N, entropy_N, collision_N, entropy_grad)

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
            return grad_NV, *NO_GRADS
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
        return grad_NV, *NO_GRADS
